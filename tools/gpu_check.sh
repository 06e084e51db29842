#!/usr/bin/env bash
# The one prepared check for a CUDA machine (an H200 lent for ~15 minutes: Python 3.12, torch
# with CUDA, no internet; megatron-core, fla, torchao and Transformer Engine not installed).
#   bash tools/fetch_gpu_wheels.sh      # HERE, with internet: the wheels into .whl/ (git-ignored)
#   bash tools/gpu_check.sh             # THERE, from the repo root, with .whl/ carried along
# Installs the wheels into /tmp/site, megamoe from this checkout, reports the environment,
# runs the GPU tests (`pytest -m gpu`: the cuda backend's roles against local in fp32 and
# bf16, fla against megamoe's ops, FP8 roles against bf16, tiered experts' device cache and
# side-stream reads against resident experts, a tiny model's loss curve on the
# GPU against the CPU), then tools/bench_gpu.py. Each phase has its own time limit; logs go
# to $OUT (or outputs/gpu_check) so a partial run still reports.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-outputs/gpu_check}"
mkdir -p "$LOG"
export PYTHONDONTWRITEBYTECODE=1 MEGAMOE_FUSION=off TOKENIZERS_PARALLELISM=false

phase() {  # phase NAME SECONDS CMD...: run with a limit, log, never stop the script
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  tail -n 25 "$LOG/$name.log"
}

if ls .whl/*.whl >/dev/null 2>&1; then
  phase install 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .whl/ folder: run tools/fetch_gpu_wheels.sh where there is internet and carry .whl"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# megamoe from this checkout without touching the machine's packages: layers/ and vision/ are
# megamoe.layers and megamoe.vision once installed, so install it (no deps) next to the wheels
phase megamoe 120 python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site .
phase env 60 python3 - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
for name in ("megatron.core", "fla", "torchao", "transformers", "timm", "omegaconf", "megamoe.layers"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "ok"))
    except Exception as e:  # noqa: BLE001 - a report, not a failure
        print(name, "MISSING:", type(e).__name__, str(e).splitlines()[0])
EOF
phase tests 300 python3 -m pytest tests -m gpu -q -p no:cacheprovider --timeout=240 -rs
phase bench 240 python3 tools/bench_gpu.py
echo "logs in $LOG"
