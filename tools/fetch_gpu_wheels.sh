#!/usr/bin/env bash
# Download, where there is internet, the wheels tools/gpu_check.sh installs on a CUDA machine
# that has Python 3.12 and torch but no internet: megatron-core, fla (flash-linear-attention +
# fla-core), torchao, omegaconf (+ antlr4 runtime), setuptools and wheel. They land in .whl/
# (git-ignored, ~9 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
# setuptools + wheel: gpu_check.sh installs megamoe itself with --no-build-isolation
WHEELS=(megatron-core==0.19.2 fla-core==0.6.0 flash-linear-attention==0.6.0 torchao==0.18.0
        omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 setuptools==80.9.0 wheel==0.45.1)
for spec in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls -la .whl
