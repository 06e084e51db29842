"""What a CPU can check of the GPU path (the device runs tests/test_gpu.py): the collective
backend a run picks, the te backend's stage-wide FP8 autocast and amax group, its recipes'
hardware and alignment limits."""
from __future__ import annotations

import pytest
import torch

from megamoe.core.errors import ConfigError
from megamoe.layers import backends
from megamoe.layers.backends import LocalBackend, register_backend


def test_the_collective_backend_follows_the_runs_device(monkeypatch):
    """A CPU run on a GPU machine (a GPU test's CPU reference) gets gloo: its tensors are on the
    CPU. It got NCCL when the choice followed CUDA's presence."""
    from megamoe.parallel.groups import dist_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dist_backend(torch.device("cpu")) == "gloo"
    assert dist_backend("cuda") == "nccl" and dist_backend(torch.device("cuda", 1)) == "nccl"
    assert dist_backend(None) == "nccl"  # no run device given: CUDA where present


class StageRecording(LocalBackend):
    """The local backend, noting the stage contexts opened and whether the router GEMM (one of
    the roles a stage's layers call) ran inside one."""

    name = "stage_recording"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.opened, self.inside, self.depth = [], [], 0

    def stage_context(self, groups):
        import contextlib

        @contextlib.contextmanager
        def noted():
            self.opened.append(groups)
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
        return noted()

    def router_logits(self, ctx):
        logits = super().router_logits(ctx)
        return lambda x, w: (self.inside.append(self.depth), logits(x, w))[1]


def test_a_stage_forward_runs_its_layers_inside_the_backends_stage_context():
    """The te backend's FP8 autocast is opened once per stage forward, with the stage's groups
    (it was opened by each GEMM, reducing amax over the world group)."""
    from megamoe.core.config import MoEConfig
    from megamoe.model.language_model import LanguageModel
    from tests.mixer_utils import tiny_model

    register_backend("stage_recording", StageRecording)
    try:
        model = LanguageModel(tiny_model("AeGe", backend="stage_recording",
                                         moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16)))
    finally:
        backends._REGISTRY.pop("stage_recording")
    model(torch.randint(0, 61, (1, 5))).sum().backward()
    backend = model.ctx.backend
    assert backend.opened == [model.groups] and backend.inside == [1, 1]


def _amax_ranks(parallel):
    import torch.distributed as dist

    from megamoe.parallel.groups import build_groups

    amax = build_groups(parallel).amax
    return None if amax is None else dist.get_process_group_ranks(amax)


def test_the_amax_group_spans_tensor_data_context_of_one_stage(pool):
    from megamoe.core.config import ParallelConfig

    assert pool(2).run(_amax_ranks, ParallelConfig(tp=2)) == [[0, 1], [0, 1]]
    assert pool(2).run(_amax_ranks, ParallelConfig()) == [[0, 1], [0, 1]]  # data parallel
    assert pool(2).run(_amax_ranks, ParallelConfig(pp=2)) == [None, None]  # each stage alone: no reduction


def test_mxfp8_needs_blackwell_and_32_element_alignment():
    from megamoe.layers.backends.te import FP8_ALIGN, recipe_refusal

    assert recipe_refusal("mxfp8", (9, 0)) == ("train.fp8='mxfp8' needs compute capability 10.0 or more "
                                               "(Blackwell); this GPU is 9.0: use blockwise or current")
    assert recipe_refusal("mxfp8", (10, 0)) is None and recipe_refusal("mxfp8", None) is None
    assert all(recipe_refusal(r, (9, 0)) is None for r in ("delayed", "current", "blockwise"))
    assert FP8_ALIGN.get("mxfp8") == 32 and FP8_ALIGN.get("delayed", 16) == 16


def test_mxfp8_is_refused_when_the_backend_is_built(monkeypatch):
    """On an H100/H200 the refusal comes at build, one line, not from TE at the first forward."""
    from megamoe.layers.backends.te import TEBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(ConfigError, match=r"^train.fp8='mxfp8' needs compute capability 10.0"):
        TEBackend(fp8="mxfp8")
