"""The backends the CPU tests run: every available one except ``cuda`` (its tensors would have
to live on the device; tests/test_gpu.py runs it there), plus ``cuda_on_cpu``, the cuda
backend's roles on CPU tensors, where its CUDA-only kernels (fla) fall back to the torch ops,
so its role wiring (FP8 roles included) is checked on every machine."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from megamoe.layers.backends import available_backends, get_backend, register_backend
from megamoe.layers.backends.cuda import FP8_RECIPES, CudaBackend
from megamoe.parallel.groups import ParallelGroups
from megamoe.layers.spec import BuildContext


class CudaOnCpu(CudaBackend):
    name = "cuda_on_cpu"


CPU_BACKENDS = [b for b in available_backends() if b != "cuda"] + ["cuda_on_cpu"]


@contextmanager
def cuda_on_cpu_registered():
    """``cuda_on_cpu`` in the registry for the duration (a module-scoped fixture wraps it)."""
    from megamoe.layers import backends

    register_backend("cuda_on_cpu", CudaOnCpu, fp8=FP8_RECIPES)
    try:
        yield
    finally:
        backends._REGISTRY.pop("cuda_on_cpu")


def ctx_for(backend: str, fp8: str | None = None) -> BuildContext:
    """A one-process build context at role-test sizes (hidden 16, fp32) on ``backend``."""
    return BuildContext(hidden_size=16, groups=ParallelGroups(), backend=get_backend(backend, fp8=fp8),
                        sequence_parallel=False, norm_eps=1e-6, norm_zero_centered=False, init_std=0.2, num_layers=2,
                        dtype=torch.float32, device=None)
