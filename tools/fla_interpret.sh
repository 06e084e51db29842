#!/usr/bin/env bash
# fla's kernels through Triton's interpreter on CPU (TRITON_INTERPRET=1): the cuda backend's fla
# calls against the local backend, forward and every input gradient (tests/test_fla_interpret.py).
#   bash tools/fla_interpret.sh               # fla-core into .fla-interp/ (git-ignored) once, then the tier
#   bash tools/fla_interpret.sh -k lightning  # extra arguments go to pytest
#   PYTHON=/path/to/python bash tools/fla_interpret.sh   # a Python that already imports fla
# fla stays out of the main test environment (there it would break transformers' CPU reference
# models): it is importable only inside this script, from its own folder or the given Python.
# Triton comes from the environment (torch's dependency). Slow (numpy runs each program
# instance): tiny shapes, a few minutes. Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=.fla-interp
FLA=fla-core==0.6.0
if ! "$PY" -c "import triton" 2>/dev/null; then
  echo "error: $PY cannot import triton (it comes with torch on Linux x86-64)" >&2
  exit 2
fi
if ! "$PY" -c "import fla" 2>/dev/null; then
  if [ ! -d "$SITE/fla" ]; then
    wheel=$(ls .whl/fla_core-0.6.0-*.whl 2>/dev/null | head -n 1 || true)
    if [ -n "$wheel" ]; then  # carried by tools/fetch_gpu_wheels.sh: no index needed
      "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$wheel"
    else
      "$PY" -m pip install -q --no-deps --target "$SITE" "$FLA"
    fi
  fi
  export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# tools/triton_site: one config per kernel (timing needs a driver) and tensor loop variables
export PYTHONPATH="$PWD/tools/triton_site:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=1 MEGAMOE_AUTOTUNE_CONFIGS=1
export MEGAMOE_FUSION=off PYTHONDONTWRITEBYTECODE=1
exec "$PY" -m pytest tests/test_fla_interpret.py -m interpret -q -p no:cacheprovider -rs "$@"
