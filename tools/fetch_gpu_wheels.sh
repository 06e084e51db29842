#!/usr/bin/env bash
# Download, where there is internet, the wheels tools/gpu_check.sh installs on a CUDA machine
# that has Python 3.12, torch, transformers, timm and pytest but no internet: megatron-core (the
# version the CPU tests run), fla (fla-core + flash-linear-attention), omegaconf (+ its antlr4
# runtime) and timm at the CPU tests' version (megamoe.vision imports layers and models that a
# machine's older timm may lack: one missing name there and test collection stops with zero
# tests run). They land in .whl/ (git-ignored, ~8 MB); carry it to the device (docs/gpu.md).
# megamoe itself is not installed there: it runs from the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(megatron-core==0.16.1 fla-core==0.6.0 flash-linear-attention==0.6.0 omegaconf==2.4.0
        antlr4-python3-runtime==4.13.2 timm==1.0.31)
for spec in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls -la .whl
