#!/usr/bin/env bash
# The test suite: unit, multi-process (gloo) parity, transformers parity; GPU tests skip on CPU.
#   bash tests/run.sh                # everything
#   bash tests/run.sh -k moe -x      # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source pretrain_scripts/env.sh
exec python -m pytest tests -q --timeout=900 -p no:cacheprovider "$@"
