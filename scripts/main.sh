#!/usr/bin/env bash
# Sets up the environment, then the main job on the embedded default model: reasoning traces ->
# golden labels -> supervised fit of the learned scorer -> teacher-forced evaluation of every policy
# (the learned one included) on held-out traces, ending with the comparison table.
# A smaller run of configs/default.yaml (the recipe of the shipped scorer) so it fits in minutes on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out=${1:-runs/main}
foresight fit --config configs/default.yaml --out "$out" \
  --set traces.num=24 --set traces.max_new_tokens=512 \
  --set data.holdout=0.25 --set trainer.max_steps=120
foresight eval --traces "$out/traces" --holdout 0.25 --policies all --scorer "$out/scorer" \
  --budgets 128 --interval 32 --out "$out/eval"
