#!/usr/bin/env bash
# Sets up the environment and runs the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
foresight demo "$@"
