"""What a CPU can check of the GPU path (the device runs tests/test_gpu.py): the collective
backend a run picks, the te backend's stage-wide FP8 autocast and amax group, its recipes'
hardware and alignment limits."""
from __future__ import annotations

import sys

import pytest
import torch

from megamoe.core.errors import ConfigError
from megamoe.layers import backends
from megamoe.layers.backends import LocalBackend, register_backend
from megamoe.layers.backends.te import TE_RECIPES, TEBackend
from tests.numerics import rel_err


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
    (it was opened by each GEMM, reducing amax over the world group); the last stage's MTP depth
    runs inside it too (it opened one per GEMM)."""
    from megamoe.core.config import MoEConfig, MTPConfig
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.mtp import MTPTargets
    from tests.mixer_utils import tiny_model

    register_backend("stage_recording", StageRecording)
    try:
        model = LanguageModel(tiny_model("AeGe", backend="stage_recording", mtp=MTPConfig(num_layers=1, layout="Ae"),
                                         moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16)))
    finally:
        backends._REGISTRY.pop("stage_recording")
    ids = torch.randint(0, 61, (1, 5))
    model.forward_stage(ids, mtp=MTPTargets(ids, shift_labels(ids), [0.1])).sum().backward()
    backend = model.ctx.backend
    assert backend.opened == [model.groups] and backend.inside == [1, 1, 1]


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


# ---- the te backend's FP8 structure against a stand-in for Transformer Engine ---------------

class FakeTE:
    """The two things megamoe calls of ``transformer_engine.pytorch`` (``fp8_autocast`` and
    ``Linear``) and its recipe classes, recording each autocast opened (recipe, group) and each
    GEMM (its input's shape and how many autocasts were open). ``Linear`` computes with the
    parameters it holds when called, as TE's does: megamoe lends it the layer's own."""

    def __init__(self):
        import dataclasses
        import enum
        import types

        self.autocasts, self.gemms, self.depth = [], [], 0
        recipe = types.ModuleType("transformer_engine.common.recipe")
        recipe.Format = enum.Enum("Format", "E4M3 HYBRID")
        for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
            fields = [("fp8_format", object, None), ("amax_history_len", int, 1), ("amax_compute_algo", str, "max")]
            if name == "DelayedScaling":
                fields.append(("reduce_amax", bool, True))
            setattr(recipe, name, dataclasses.make_dataclass(name, fields))
        pt = types.ModuleType("transformer_engine.pytorch")
        pt.fp8_autocast, pt.Linear = self.fp8_autocast, self.linear_class()
        common = types.ModuleType("transformer_engine.common")
        common.recipe = recipe
        self.modules = {"transformer_engine": types.ModuleType("transformer_engine"),
                        "transformer_engine.pytorch": pt, "transformer_engine.common": common,
                        "transformer_engine.common.recipe": recipe}
        self.modules["transformer_engine"].pytorch, self.modules["transformer_engine"].common = pt, common

    def fp8_autocast(self, enabled, fp8_recipe, fp8_group):
        import contextlib

        @contextlib.contextmanager
        def opened():
            self.autocasts.append((fp8_recipe, fp8_group))
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
        return opened()

    def linear_class(self):
        te = self

        class Linear(torch.nn.Module):
            def __init__(self, in_f, out_f, bias, params_dtype, device):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.empty(out_f, in_f, dtype=params_dtype, device=device))
                self.bias = torch.nn.Parameter(torch.empty(out_f, dtype=params_dtype, device=device)) if bias else None

            def forward(self, x):
                te.gemms.append((tuple(x.shape), te.depth))
                return torch.nn.functional.linear(x, self.weight, self.bias)
        return Linear


@pytest.fixture
def fake_te(monkeypatch):
    te = FakeTE()
    for name, module in te.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    register_backend("te_fake", TEBackend, fp8=TE_RECIPES)
    yield te
    backends._REGISTRY.pop("te_fake")


def test_a_te_model_opens_one_autocast_per_forward_and_every_gemm_runs_inside(fake_te):
    """delayed: one autocast per stage forward (it was one per GEMM), this run's amax group
    (None: one rank, so the recipe reduces nothing); every linear's GEMM through TE inside it;
    the logits those of the same weights on the local backend."""
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize
    from tests.mixer_utils import tiny_model

    model = LanguageModel(tiny_model("AdGd", backend="te_fake"), fp8="delayed")
    initialize(model, model.groups, seed=0)
    local = LanguageModel(tiny_model("AdGd", backend="local"))
    local.load_state_dict(model.state_dict())
    ids = torch.randint(0, 61, (1, 16))
    got = model(ids)
    got.sum().backward()
    (recipe, group), = fake_te.autocasts
    assert group is None and recipe.reduce_amax is False and recipe.fp8_format.name == "HYBRID"
    assert len(fake_te.gemms) >= 6 and all(depth == 1 for _, depth in fake_te.gemms), fake_te.gemms
    assert rel_err(got, local(ids)) <= 1e-6


def test_te_gemms_pad_rows_to_the_recipes_alignment_and_open_their_own_autocast_outside_a_stage(fake_te, monkeypatch):
    """mxfp8 on a Blackwell-class device: rows padded to 32 (16 for the other recipes), widths
    that are not multiples of 32 run outside TE; a GEMM outside a stage forward (a recomputation)
    opens its own autocast with the stage's group."""
    from megamoe.layers.backends.te import TEGemm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    cases = {"mxfp8": (64, 32, 48), "blockwise": (64, 16, 40), "current": (48, 16, 40)}
    for name, (aligned, rows, odd) in cases.items():
        backend = TEBackend(fp8=name)
        gemm = TEGemm(backend._scope(type("G", (), {"amax": "stage"})()), backend.align)
        x, w = torch.randn(5, 3, aligned), torch.randn(aligned, aligned)
        fake_te.gemms.clear(), fake_te.autocasts.clear()
        assert rel_err(gemm(x, w), x @ w.T) <= 1e-6
        assert fake_te.gemms == [((rows, aligned), 1)] and [g for _, g in fake_te.autocasts] == ["stage"], name
        assert rel_err(gemm(x[..., :odd], w[:odd, :odd]), x[..., :odd] @ w[:odd, :odd].T) <= 1e-6
        assert len(fake_te.gemms) == 1, f"{name}: width {odd} went through TE"


# ---- the tiered expert cache's stream order, through stand-in streams ----------------------

class Streams:
    """Stand-ins for ``torch.cuda``'s streams and events that log, in call order, each event
    recorded (``record``, stream, event) and waited for (``wait``, stream, event)."""

    def __init__(self):
        self.log, self.current = [], self.Stream("main", self)

    class Stream:
        def __init__(self, name, streams):
            self.name, self.streams = name, streams

        def wait_event(self, event):
            self.streams.log.append(("wait", self.name, event.n))

    def event(self):
        streams = self

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.n = Event.count

            def record(self, stream):
                streams.log.append(("record", stream.name, self.n))
        return Event

    def patch(self, monkeypatch):
        import contextlib

        monkeypatch.setattr(torch.cuda, "Stream", lambda device: self.Stream("side", self))
        monkeypatch.setattr(torch.cuda, "Event", self.event())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)


def test_the_cache_refills_a_slot_after_the_copy_out_of_it(monkeypatch):
    """One slot, two experts: expert 1 is filled on the side stream (event 1), the main stream
    waits for it, copies it out and records event 2; expert 2 evicts it, and its fill waits on
    the side stream for event 2 before it copies (it did not: on a GPU the refill could
    overwrite the slot under the queued copy out; tests/test_gpu.py shows it on a device)."""
    from megamoe.expert_store.slot_cache import ExpertCache, StreamOrder

    class HostOrder(StreamOrder):  # pageable host buffers: this torch has no CUDA to pin with
        def host_buffers(self, shapes, dtype):
            return tuple(torch.empty(s, dtype=dtype) for s in shapes)

    streams = Streams()
    streams.patch(monkeypatch)
    shapes = ((4, 3), (3, 2))
    cache = ExpertCache(4 * 18, "cpu", torch.float32, shapes, lambda key, w1, w2: (w1.fill_(key), w2.fill_(key)),
                        prefetch=False, order=HostOrder(torch.device("cpu")))
    outs = {key: [torch.zeros(s) for s in shapes] for key in (1, 2, 1)}
    for key in (1, 2, 1):
        cache.copy(key, *outs[key])
    assert cache.size == 1 and all((o == key).all() for key in (1, 2) for o in outs[key])
    fill_copy_out = [("record", "side", 1), ("wait", "main", 1), ("record", "main", 2)]
    refill = [("wait", "side", 2), ("record", "side", 3), ("wait", "main", 3), ("record", "main", 4),
              ("wait", "side", 4), ("record", "side", 5), ("wait", "main", 5), ("record", "main", 6)]
    assert streams.log == fill_copy_out + refill, streams.log
    cache.close()
