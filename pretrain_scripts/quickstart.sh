#!/usr/bin/env bash
# Quickstart: set up .venv (first run only), then build the shipped tiny recipe, print its
# layout and parameter budget, and run one forward+backward step on the CPU.
#   CONFIG=tiny_dense bash pretrain_scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source pretrain_scripts/env.sh
CONFIG="${CONFIG:-tiny_dense}"
echo "[quickstart] recipe $CONFIG"
python tools/show_model.py --config "$CONFIG" --step
