#!/usr/bin/env bash
# The GPU acceptance run (scripts/gpu_acceptance.py): on a CUDA machine with no network, installs the
# carried wheels (wheels/gpu, made by scripts/gpu-wheels.sh) and the project, then runs every step under its
# own time cap and writes the report into --out (default: $OUT). With --cpu-dry-run it installs nothing and
# runs the same steps at tiny shapes on the CPU. Options are the Python driver's (--help).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ " $* " != *" --cpu-dry-run "* && " $* " != *" --help "* ]]; then
  if compgen -G "wheels/gpu/*.whl" >/dev/null; then
    # --no-deps: the image holds every other need. The source archives (pycosat, C) build there with the
    # image's compiler and setuptools, each on its own so that a failed build costs only its own package.
    "$PYTHON" -m pip install -q --no-index --no-deps --no-cache-dir wheels/gpu/*.whl \
      || echo "gpu-acceptance: installing wheels/gpu failed; the imports step names what is missing" >&2
    for source in wheels/gpu/*.tar.gz; do
      [ -e "$source" ] || continue
      "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir "$source" \
        || echo "gpu-acceptance: building $source failed" >&2
    done
  else
    echo "gpu-acceptance: no wheels/gpu (run scripts/gpu-wheels.sh where there is network, carry wheels/gpu)" >&2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    || echo "gpu-acceptance: installing the project failed; the steps import it from the checkout" >&2
fi
exec "$PYTHON" scripts/gpu_acceptance.py "$@"
