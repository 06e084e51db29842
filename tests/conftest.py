"""Shared fixtures: reusable gloo process pools and numeric helpers."""
from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

# compiled fusion (megamoe.layers.ops.fusion) costs 5-20 s per kernel variant on a fresh machine; the suite
# runs the eager kernels (gloo pools and subprocesses inherit this) and tests/test_fusion.py
# checks the compiled ones against them
os.environ.setdefault("MEGAMOE_FUSION", "off")

from tests.dist import DistPool  # noqa: E402

# one thread: tiny shapes gain little from two, and OpenMP threads spin badly when other
# processes (the gloo pools, or other jobs) share the cores
torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


@pytest.fixture(scope="session")
def pool():
    """``pool(n)``: a DistPool of n gloo processes, started once per session."""
    pools: dict[int, DistPool] = {}

    def get(n: int) -> DistPool:
        if n not in pools or pools[n].broken:
            pools[n] = DistPool(n)
        return pools[n]

    yield get
    for p in pools.values():
        p.stop()
    deadline = time.monotonic() + 10
    for p in pools.values():
        p.join(deadline)


def pytest_collection_modifyitems(config, items):
    """A test that is skipped without CUDA must be marked ``gpu``: the device runs ``-m gpu`` and
    would never run it otherwise (tests/test_delta_rule.py had one). Collection fails naming it."""
    unmarked = [item.nodeid for item in items if item.get_closest_marker("gpu") is None
                and any("CUDA" in str(m.kwargs.get("reason", "")).upper() for m in item.iter_markers("skipif"))]
    if unmarked:
        raise pytest.UsageError(f"tests skipped without CUDA but not marked gpu: {', '.join(unmarked)}")
    if config.getoption("markexpr") == "gpu":  # the device run: tests/test_gpu.py's decisive checks first
        items.sort(key=lambda item: item.path.name != "test_gpu.py")
