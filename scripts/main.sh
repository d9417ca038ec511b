#!/usr/bin/env bash
# Sets up the environment, then the main job on the embedded default model: reasoning traces ->
# golden labels -> supervised fit of the learned scorer -> teacher-forced evaluation of every policy
# (the learned one included, at the budget it was trained for) on held-out traces at three budgets,
# ending with the comparison table (every figure with its bootstrap interval) and plots against B.
# A smaller run of configs/default.yaml (the recipe of the shipped scorer) so it fits in minutes on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out=${1:-runs/main}
foresight fit --config configs/default.yaml --out "$out" \
  --set data.generate.num=24 --set data.generate.max_new_tokens=512 \
  --set data.holdout=0.25 --set trainer.max_steps=120
for budget in 64 256; do  # fit labelled B = 128; golden needs labels at every budget of the sweep
  foresight labels --traces "$out/traces" --budget "$budget" --interval 32
done
foresight eval --traces "$out/traces" --holdout 0.25 --policies all --scorer "$out/scorer" \
  --budgets 64,128,256 --interval 32 --out "$out/eval"
