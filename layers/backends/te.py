"""``te``: the ``cuda`` backend with its linear GEMMs run by NVIDIA Transformer Engine, under one
of TE's FP8 recipes (``train.fp8=delayed|current|blockwise|mxfp8``; without ``train.fp8`` the
TE GEMMs run in the autocast dtype).

What TE runs, and what stays as in ``cuda``:

- the column, row and replicated linears: each keeps megamoe's own parameters (names, sharding,
  init and checkpoints are those of every backend, so a model trained with ``te`` exports like one
  trained with ``local``) and runs its local GEMM through a ``transformer_engine.pytorch.Linear``
  that borrows those parameters for the call, inside ``fp8_autocast`` with the chosen recipe.
  The TE module is not a submodule: its FP8 scaling state is not in megamoe's checkpoints (TE
  rebuilds it within a few steps, as after any TE checkpoint load without extra state).
  Widths FP8 GEMMs reject (not multiples of 16) run in the autocast dtype.
- the routed experts: torch's FP8 grouped GEMM of the ``cuda`` backend (row-wise e4m3 scales,
  whatever the recipe). TE's ``GroupedLinear`` keeps one weight parameter per expert, megamoe one
  stacked [E, ...] tensor per projection (what EP sharding, placement, tiered storage and the HF
  converters address); bridging them would copy every expert weight every step.
- norms, attention cores, linear-attention ops (fla), the router GEMM: as in ``cuda``.

The tensor-parallel communication stays megamoe's (``megamoe.parallel.linear``): TE modules are
built with ``tp_size=1`` and see only this rank's shard.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megamoe.core.errors import ConfigError
from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from megamoe.layers.spec import BuildContext
from megamoe.layers.backends.cuda import CudaBackend

TE_RECIPES = ("delayed", "current", "blockwise", "mxfp8")


def missing() -> str | None:
    """What the te backend lacks here (None: it can run)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed (pip install 'megamoe[te]' on a CUDA machine)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


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


class TEGemm:
    """One linear's local GEMM through ``transformer_engine.pytorch.Linear``.

    x [..., in] @ weight[out, in]^T (+ bias) -> [..., out]. The TE module is made at the first
    call, on the input's device with the weight's dtype, and borrows the caller's parameters for
    each call (they may have been re-materialised since: shard-local init, checkpoint loads)."""

    def __init__(self, recipe):
        self.recipe, self.module = recipe, None

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
        fp8 = self.recipe is not None and in_f % 16 == 0 and out_f % 16 == 0
        if self.recipe is not None and not fp8:
            return F.linear(x, weight, bias)  # FP8 GEMMs need widths in multiples of 16
        module = self._module(weight, bias, x.device)
        if not fp8:
            return module(x)
        import transformer_engine.pytorch as te

        rows = x.numel() // in_f
        pad = (-rows) % 16  # FP8 GEMMs also want the token count in multiples of 16 (8 for some recipes)
        flat = x.reshape(rows, in_f)
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        with te.fp8_autocast(enabled=True, fp8_recipe=self.recipe):
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
        self.te_fp8, self.recipe = fp8, make_recipe(fp8)

    def __repr__(self) -> str:
        return f"TEBackend(fusion={self.fusion.mode!r}, fp8={self.te_fp8!r})"

    @property
    def experts_fp8(self) -> bool:  # the cuda backend's grouped_experts builds them (tiered store included)
        return self.te_fp8 is not None

    def _with_gemm(self, linear):
        # a plain attribute (not a submodule): the TE module's state stays out of megamoe's state dicts
        object.__setattr__(linear, "te_gemm", TEGemm(self.recipe))
        return linear

    def column_linear(self, ctx: BuildContext, in_features, out_features, **kw):
        return self._with_gemm(super().column_linear(ctx, in_features, out_features, **kw))

    def row_linear(self, ctx: BuildContext, in_features, out_features, **kw):
        return self._with_gemm(super().row_linear(ctx, in_features, out_features, **kw))

    def replicated_linear(self, ctx: BuildContext, in_features, out_features, **kw):
        return self._with_gemm(super().replicated_linear(ctx, in_features, out_features, **kw))
