# Sourced by the scripts here and by tests/run.sh: creates or reuses .venv in the repo and
# installs megamoe (editable) with the hf and dev extras. Safe to source repeatedly.
#   MEGAMOE_VENV  virtualenv path (default: <repo>/.venv)
#   TORCH_SPEC    what pip installs when the venv has no torch
#                 (default: torch==2.14.1 torchvision==0.29.1, the builds this machine has on disk)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGAMOE_VENV:-$REPO/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[env] creating $VENV"
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"   # reuse a preinstalled torch (GPU machines)
  else
    "$PY" -m venv "$VENV"
  fi
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# presence checks find the modules without importing them (an import of torch costs seconds,
# paid by every script and test run that sources this)
env_has() { python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in sys.argv[1:]))" "$@" 2>/dev/null; }
if ! env_has torch torchvision; then
  echo "[env] installing ${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"
  # shellcheck disable=SC2086
  pip install -q ${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}
fi
STAMP="$VENV/.megamoe-installed"
if [ ! -f "$STAMP" ] || [ "$REPO/setup.py" -nt "$STAMP" ] || ! env_has megamoe.layers; then
  echo "[env] installing megamoe[hf,dev] (editable)"
  pip install -q -e "$REPO[hf,dev]" && touch "$STAMP"
fi
unset -f env_has
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning:megatron,ignore::FutureWarning}"
export TOKENIZERS_PARALLELISM=false
