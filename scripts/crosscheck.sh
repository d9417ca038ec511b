#!/usr/bin/env bash
# Cross-checks our policies, and the learned scorer's kvpress press, against NVIDIA kvpress in a second
# virtualenv (.venv-kvpress): kvpress pins transformers < 5.3, so this also proves the runtime on
# transformers 5.2. docs/kvpress.md says what each test compares.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-kvpress/bin/python ]; then
  python3 -m venv .venv-kvpress
fi
. .venv-kvpress/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q kvpress "transformers==5.2.*" -c <(printf 'torch==2.13.0\n')
python -m pip install -q -e ".[dev]" -c <(printf 'torch==2.13.0\ntransformers==5.2.0\n')
python -m pytest tests/test_kvpress_crosscheck.py tests/test_kvpress_learned.py -q "$@"
