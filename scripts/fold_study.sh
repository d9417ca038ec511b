#!/usr/bin/env bash
# The fold study (studies/folds/spec.yaml) in the background on a 2-core machine: one regime (decode unless
# given), one process on folds 0-2 and one on 3-4, each on one torch thread, each resuming from
# studies/folds/record; they share the labels and example caches by claims. Logs: runs/folds-REGIME-*.log.
# Commit studies/folds/record before the machine goes: it is all the study keeps.
set -euo pipefail
cd "$(dirname "$0")/.."
regime=${1:-decode}
case $regime in decode | streaming) ;; *) echo "scripts/fold_study.sh: regime '$regime' must be decode or streaming" >&2; exit 2 ;; esac
. .venv/bin/activate
mkdir -p runs
for share in "0,1,2" "3,4"; do
  name=folds-$regime-${share//,/}
  sed "s/^regime: .*/regime: [$regime]/; s#^out: .*#out: runs/studies/$name.md#" studies/folds/spec.yaml > "runs/$name.yaml"
  echo "fold: [$share]" >> "runs/$name.yaml"
  OMP_NUM_THREADS=1 nohup python -m studies folds --spec "runs/$name.yaml" > "runs/$name.log" 2>&1 &
  echo "started $name (pid $!, log runs/$name.log)"
done
