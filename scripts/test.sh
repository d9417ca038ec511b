#!/usr/bin/env bash
# Sets up the environment, checks formatting and lint (ruff), then runs the whole test suite (slow
# end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff format --check --quiet .
ruff check --quiet .
python -m pytest tests "$@"
