#!/usr/bin/env bash
# The one prepared check for a lent GPU (docs/gpu.md): an H100 or H200 with Python 3.12, torch 2.11
# with CUDA, transformers, timm and pytest, no internet, about 15 minutes of device time in all.
#   bash tools/fetch_gpu_wheels.sh       # here, with internet: .whl/ (megatron-core, fla, omegaconf)
#   bash tools/gpu_check.sh              # there, from the checkout's root, .whl carried: one call
#   bash tools/gpu_check.sh --rehearse   # any machine (the test suite runs it): the same steps
#                                        # without the GPU work
# Phases, decisive first, each under its own time limit; the limits add up to at most 8 minutes
# (checked before anything runs), 2 to spare in a 10-minute device command; a rehearsal allows 10x
# each (it checks the steps on a shared CPU, not the speed):
#   install  the carried wheels into a fresh folder, --no-index (a rehearsal installs them for
#            Python 3.12 into a folder it does not import from); megamoe runs from this checkout
#   env      versions, the GPU, every module of the checkout imported from the checkout
#   tests    pytest -m gpu, tests/test_gpu.py first, slowest durations shown (a rehearsal
#            collects the same selection, which must have no errors)
#   bench    tools/bench_gpu.py at its defaults, sized to the phase (a rehearsal: --plan)
# fla's kernels try one autotune config each (tools/triton_site): a cold autotune of every kernel
# in every process would take minutes. Logs go to $OUT (or outputs/gpu_check); the last line:
#   gpu_check: P passed F failed S skipped; mfu_bf16=… gpu_speedup_vs_hf=… grouped_vs_dense=… fp8_speedup=…
# Exit status 0 when every phase passed and no test failed, 1 otherwise, 2 for a wrong argument.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=device
case "${1:-}" in
  --rehearse) MODE=rehearse ;;
  "") ;;
  *) echo "usage: bash tools/gpu_check.sh [--rehearse]" >&2; exit 2 ;;
esac
LOG="${OUT:-outputs/gpu_check}"
mkdir -p "$LOG"
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
PHASES=(install:30 env:60 tests:260 bench:120)
total=0
for p in "${PHASES[@]}"; do total=$((total + ${p#*:})); done
echo "== gpu_check ($MODE): phase limits ${PHASES[*]}, ${total}s of a ${BUDGET_S}s budget"
if [ "$total" -gt "$BUDGET_S" ]; then
  echo "gpu_check: the phase limits add up to ${total}s, over the ${BUDGET_S}s budget"
  exit 1
fi

export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 MEGAMOE_FUSION=off TOKENIZERS_PARALLELISM=false \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MEGAMOE_AUTOTUNE_CONFIGS=1
export MODE PY
SLACK=1  # a rehearsal checks the steps, not the device's speed: 10x the limits on a shared CPU
[ "$MODE" = rehearse ] && SLACK=10
if [ "$MODE" = device ]; then
  export SITE="${TMPDIR:-/tmp}/megamoe_gpu_site"
  # this checkout first: megamoe, and its layers/ and vision/, from here, never an installed copy
  export PYTHONPATH="$PWD/tools/triton_site:$PWD:$SITE"
else
  export SITE="$LOG/site-py312"  # Python 3.12 wheels: installed to check them, never imported here
  export PYTHONPATH="$PWD/tools/triton_site:$PWD"
fi

install_wheels() {
  rm -rf "$SITE"  # fresh: a rerun on a warm machine never tests what an earlier run installed
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no .whl/ folder: run tools/fetch_gpu_wheels.sh where there is internet and carry .whl"
    [ "$MODE" = rehearse ]  # a rehearsal without wheels checks the rest; the device cannot
    return
  fi
  local target=()
  if [ "$MODE" = rehearse ]; then
    target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
            --platform any)
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "${target[@]}" \
    --target "$SITE" .whl/*.whl && ls "$SITE"
}
export -f install_wheels

FAILED=()
phase() {  # phase NAME CMD...: under the phase's limit, logged to $LOG/NAME.log, its tail shown
  local name=$1 lim=""
  shift
  for p in "${PHASES[@]}"; do [ "${p%%:*}" = "$name" ] && lim=$((${p#*:} * SLACK)); done
  echo "== $name (limit ${lim}s)"
  local t0=$SECONDS
  timeout -k 10 "$lim" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s$([ "$rc" -ge 124 ] && echo ' (time limit)')"
  tail -n 30 "$LOG/$name.log"
  [ "$rc" -eq 0 ] || FAILED+=("$name")
}

SELECT=(tests -m gpu -p no:cacheprovider)  # tests/conftest.py puts tests/test_gpu.py first
phase install bash -c install_wheels
if [ "$MODE" = device ]; then
  phase env "$PY" tools/gpu_check.py env
  phase tests "$PY" -m pytest "${SELECT[@]}" -q -rs --durations=15 --timeout=150 --junitxml="$LOG/tests.xml"
  phase bench "$PY" tools/bench_gpu.py
else
  phase env "$PY" tools/gpu_check.py env --rehearse
  phase tests "$PY" -m pytest "${SELECT[@]}" --collect-only -q
  phase bench "$PY" tools/bench_gpu.py --plan
fi
echo "logs in $LOG"
FAILED_LIST=$(IFS=,; echo "${FAILED[*]:-}")
"$PY" tools/gpu_check.py summary "$LOG" --failed-phases "$FAILED_LIST" $([ "$MODE" = rehearse ] && echo --rehearse)
