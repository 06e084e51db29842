"""``te``: the ``cuda`` backend with its linear GEMMs run by NVIDIA Transformer Engine, under one
of TE's FP8 recipes (``train.fp8=delayed|current|blockwise|mxfp8``; without ``train.fp8`` the
TE GEMMs run in the autocast dtype).

What TE runs, and what stays as in ``cuda``:

- the column, row and replicated linears: each keeps megamoe's own parameters (names, sharding,
  init and checkpoints are those of every backend, so a model trained with ``te`` exports like one
  trained with ``local``) and runs its local GEMM through a ``transformer_engine.pytorch.Linear``
  that borrows those parameters for the call. The TE module is not a submodule: its FP8 scaling
  state is not in megamoe's checkpoints (TE rebuilds it within a few steps, as after any TE
  checkpoint load without extra state). Widths FP8 GEMMs reject (not multiples of 16; 32 for
  ``mxfp8``) run in the autocast dtype; rows are padded to the same multiple.
- FP8 autocast: one ``fp8_autocast`` per pipeline stage forward (``stage_context``, entered by
  the model), reducing the scaling statistics (amax) over the stage's tensor x data x context
  group (``groups.amax``, megatron-core's amax reduction group), as Megatron does. A GEMM
  outside it (recomputed in the backward, or called directly) opens its own with the same
  group. Never the world group: with PP > 1 the stages run different GEMMs, and a reduction
  over every rank would pair collectives of different stages.
- ``mxfp8`` needs a Blackwell GPU (compute capability 10 or more): refused at build elsewhere.
- the routed experts: torch's FP8 grouped GEMM of the ``cuda`` backend (row-wise e4m3 scales,
  whatever the recipe). TE's ``GroupedLinear`` keeps one weight parameter per expert, megamoe one
  stacked [E, ...] tensor per projection (what EP sharding, placement, tiered storage and the HF
  converters address); bridging them would copy every expert weight every step.
- norms, attention cores, linear-attention ops (fla), the router GEMM: as in ``cuda``.

The tensor-parallel communication stays megamoe's (``megamoe.parallel.linear``): TE modules are
built with ``tp_size=1`` and see only this rank's shard.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import torch
import torch.nn.functional as F

from megamoe.core.errors import ConfigError
from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from megamoe.layers.spec import BuildContext
from megamoe.layers.backends.cuda import CudaBackend

TE_RECIPES = ("delayed", "current", "blockwise", "mxfp8")
FP8_ALIGN = {"mxfp8": 32}  # rows and widths of an FP8 GEMM: multiples of this (16 for the others)
MIN_CAPABILITY = {"mxfp8": (10, 0)}  # MXFP8 GEMMs: Blackwell; the others run on Hopper (9.0)


def missing() -> str | None:
    """What the te backend lacks here (None: it can run)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed (pip install 'megamoe[te]' on a CUDA machine)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def recipe_refusal(name: str | None, capability: tuple[int, int] | None) -> str | None:
    """Why recipe ``name`` cannot run on a GPU of compute ``capability`` (None: it can, or no GPU
    to ask: the backend is refused for that already)."""
    need = MIN_CAPABILITY.get(name)
    if need is None or capability is None or tuple(capability) >= need:
        return None
    return (f"train.fp8={name!r} needs compute capability {need[0]}.{need[1]} or more (Blackwell); this GPU is "
            f"{capability[0]}.{capability[1]}: use blockwise or current")


def make_recipe(name: str | None):
    """``train.fp8`` -> a Transformer Engine recipe object (None: no FP8)."""
    if name is None:
        return None
    from transformer_engine.common import recipe as r

    build = {
        # scales from the amax history of earlier steps (TE's classic recipe); e4m3 forward, e5m2 backward
        "delayed": lambda: r.DelayedScaling(fp8_format=r.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"),
        # scales from the tensor being cast, every time
        "current": lambda: r.Float8CurrentScaling(fp8_format=r.Format.HYBRID),
        # DeepSeek-V3 style 1x128 / 128x128 block scales (Hopper)
        "blockwise": lambda: r.Float8BlockScaling(fp8_format=r.Format.E4M3),
        # 32-element micro-block scales (Blackwell)
        "mxfp8": lambda: r.MXFP8BlockScaling(fp8_format=r.Format.E4M3),
    }
    if name not in build:
        raise ConfigError(f"train.fp8={name!r} is not a Transformer Engine recipe: allowed: {', '.join(TE_RECIPES)}")
    return build[name]()


class FP8Scope:
    """The FP8 autocast of one model's GEMMs: the recipe, the amax group and whether a stage
    forward has it open (``active``)."""

    def __init__(self, recipe, group):
        self.recipe, self.group, self.active = recipe, group, False
        if group is None and hasattr(recipe, "reduce_amax"):  # this rank alone: nothing to reduce
            self.recipe = dataclasses.replace(recipe, reduce_amax=False)

    @contextlib.contextmanager
    def autocast(self):
        import transformer_engine.pytorch as te

        outer, self.active = self.active, True
        try:
            with te.fp8_autocast(enabled=True, fp8_recipe=self.recipe, fp8_group=self.group):
                yield
        finally:
            self.active = outer


class TEGemm:
    """One linear's local GEMM through ``transformer_engine.pytorch.Linear``.

    x [..., in] @ weight[out, in]^T (+ bias) -> [..., out]. The TE module is made at the first
    call, on the input's device with the weight's dtype, and borrows the caller's parameters for
    each call (they may have been re-materialised since: shard-local init, checkpoint loads).
    ``scope`` None: no FP8."""

    def __init__(self, scope: FP8Scope | None, align: int = 16):
        self.scope, self.align, self.module = scope, align, None

    def _module(self, weight: torch.Tensor, bias: torch.Tensor | None, device):
        if self.module is None:
            import transformer_engine.pytorch as te

            out_f, in_f = weight.shape
            self.module = te.Linear(in_f, out_f, bias=bias is not None, params_dtype=weight.dtype, device=device)
        self.module._parameters["weight"] = weight
        if bias is not None:
            self.module._parameters["bias"] = bias
        return self.module

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out_f, in_f = weight.shape
        if self.scope is None:
            return self._module(weight, bias, x.device)(x)
        if in_f % self.align or out_f % self.align:
            return F.linear(x, weight, bias)  # FP8 GEMMs need widths in multiples of the alignment
        module = self._module(weight, bias, x.device)
        rows = x.numel() // in_f
        pad = (-rows) % self.align  # and the token count too
        flat = x.reshape(rows, in_f)
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        with contextlib.nullcontext() if self.scope.active else self.scope.autocast():
            out = module(flat)
        return out[:rows].reshape(*x.shape[:-1], out_f)


class _TELocalGemm:
    """Mixin: a megamoe parallel linear whose local product runs through ``TEGemm``
    (set by the backend as ``te_gemm``). Row-parallel bias is added after the reduction by the
    base class, so its local GEMM has none."""

    te_gemm: TEGemm  # the bias goes where the parallel class says (its local_bias)

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.te_gemm(x, self.weight, self.bias if self.local_bias else None)


class TEColumnParallelLinear(_TELocalGemm, ColumnParallelLinear):
    pass


class TERowParallelLinear(_TELocalGemm, RowParallelLinear):
    pass


class TEReplicatedLinear(_TELocalGemm, ReplicatedLinear):
    pass


class TEBackend(CudaBackend):
    name = "te"
    column_cls, row_cls, replicated_cls = TEColumnParallelLinear, TERowParallelLinear, TEReplicatedLinear

    def __init__(self, fusion: Fusion = EAGER, fp8: str | None = None):
        # the experts' FP8 is torch's (see the module docstring): the cuda backend's "torch" recipe
        super().__init__(fusion, fp8=None)
        why = recipe_refusal(fp8, torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
        if why:
            raise ConfigError(why)
        self.te_fp8, self.recipe = fp8, make_recipe(fp8)
        self.align = FP8_ALIGN.get(fp8, 16)
        self.scopes: dict[int, FP8Scope] = {}  # id(amax group) -> the scope of the GEMMs built with it

    def __repr__(self) -> str:
        return f"TEBackend(fusion={self.fusion.mode!r}, fp8={self.te_fp8!r})"

    @property
    def experts_fp8(self) -> bool:  # the cuda backend's grouped_experts builds them (tiered store included)
        return self.te_fp8 is not None

    def _scope(self, groups) -> FP8Scope | None:
        if self.recipe is None:
            return None
        key = id(groups.amax)
        if key not in self.scopes:
            self.scopes[key] = FP8Scope(self.recipe, groups.amax)
        return self.scopes[key]

    def stage_context(self, groups):
        """One FP8 autocast around the stage's forward, amax reduced over ``groups.amax``."""
        scope = self._scope(groups)
        return contextlib.nullcontext() if scope is None else scope.autocast()

    def _with_gemm(self, linear, ctx: BuildContext):
        # a plain attribute (not a submodule): the TE module's state stays out of megamoe's state dicts
        object.__setattr__(linear, "te_gemm", TEGemm(self._scope(ctx.groups), self.align))
        return linear

    def column_linear(self, ctx: BuildContext, in_features, out_features, **kw):
        return self._with_gemm(super().column_linear(ctx, in_features, out_features, **kw), ctx)

    def row_linear(self, ctx: BuildContext, in_features, out_features, **kw):
        return self._with_gemm(super().row_linear(ctx, in_features, out_features, **kw), ctx)

    def replicated_linear(self, ctx: BuildContext, in_features, out_features, **kw):
        return self._with_gemm(super().replicated_linear(ctx, in_features, out_features, **kw), ctx)
