"""``cuda``: the GPU backend, the default when CUDA is present.

- Gated DeltaNet and KDA through flash-linear-attention's Triton ops (chunked for training and
  prefill, fused-recurrent for decoding) when ``fla`` is installed; Lightning through fla's
  ``simple_gla`` ops (a per-head constant decay ``g_gamma = -slope``, no query scaling). Without
  fla (or off CUDA) the CPU backend's chunked torch ops run instead: same results, slower.
- Softmax attention through torch's SDPA (flash / memory-efficient kernels on CUDA).
- Routed experts through torch's grouped GEMM over the whole permuted batch (``grouped_mm``).
- ``fp8="torch"`` (``train.fp8=torch``): the column, row and replicated linears and the routed
  experts run their forward and input-gradient GEMMs in e4m3 with row-wise scales
  (``megamoe.layers.ops.fp8.linear``, ``megamoe.layers.ops.fp8.experts``); the router GEMM, the norms, the
  attention cores and the linear-attention ops stay in higher precision. Weights stay in their
  dtype (FP8 copies live only inside a GEMM), so checkpoints and HF export do not depend on it.

bf16 autocast comes from the trainer (``train.precision``), not from the backend.
"""
from __future__ import annotations

import importlib.util

import torch

from megamoe.core.errors import ConfigError
from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from megamoe.layers.spec import BuildContext
from megamoe.layers.backends.cpu import ChunkedDeltaRule, ChunkedLightning, CpuBackend
from megamoe.layers.mlp.experts import GroupedExperts
from megamoe.layers.ops.fp8.linear import fp8_linear
from megamoe.layers.mlp.dense import SWIGLU, GLU
from megamoe.layers.ops.fp8.experts import swiglu_experts_fp8
from megamoe.layers.ops.delta_rule.naive import expand_key_heads
from megamoe.layers.ops.delta_rule.passing import widened_passing

FP8_RECIPES = ("torch",)  # the Transformer Engine recipes (delayed, current, blockwise, mxfp8) need TE


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def _on_fla(t: torch.Tensor) -> bool:
    """fla's Triton kernels: CUDA tensors, fla installed."""
    return t.is_cuda and fla_installed()


def missing() -> str | None:
    """What the cuda backend lacks here (None: it can run)."""
    return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"


# ---- linear attention through fla ---------------------------------------------------------

def fla_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, decode: bool = False):
    """The gated delta rule through fla: its chunked op, or its fused-recurrent op for decoding.

    q, k [b, t, hk, dk]; v [b, t, hv, dv]; g [b, t, hv] (GDN) or [b, t, hv, dk] (KDA) log-decays;
    beta [b, t, hv]; initial_state [b, hv, dk, dv] or None -> (o [b, t, hv, dv], state fp32).
    fla wants one key head per value head and one dtype for q, k, v; states in fp32. Every
    argument goes by keyword: fla's fused-recurrent GDN is (q, k, v, g, gk, gv, beta, ...), so a
    positional beta would land in gk, and its ``**kwargs`` swallow a misspelt name silently.
    """
    q, k = (x.to(v.dtype) for x in expand_key_heads(q, k, v.size(2)))
    if g.dim() == 4:
        from fla.ops.kda import chunk_kda as chunk, fused_recurrent_kda as recurrent
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    state = None if initial_state is None else initial_state.float()
    return (recurrent if decode else chunk)(q=q, k=k, v=v, g=g.float(), beta=beta.to(v.dtype), scale=scale,
                                            initial_state=state, output_final_state=True)


def fla_lightning(q, k, v, slope, *, initial_state=None, decode: bool = False):
    """Lightning attention as fla's simple GLA with a per-head constant decay ``g_gamma = -slope``:
    S_t = exp(-slope) S_{t-1} + k_t^T v_t, o_t = q_t S_t (scale 1). q, k, v [b, t, h, d];
    slope [h] -> (o [b, t, h, d] in v's dtype, state [b, h, d, d] fp32). Keywords as above."""
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    fn = fused_recurrent_simple_gla if decode else chunk_simple_gla
    state = None if initial_state is None else initial_state.float()
    o, s = fn(q=q, k=k.to(q.dtype), v=v.to(q.dtype), g_gamma=-slope.float(), scale=1.0, initial_state=state,
              output_final_state=True)
    return o.to(v.dtype), s


class FlaDeltaRule(ChunkedDeltaRule):
    """``fla_delta_rule`` on CUDA tensors where fla is installed, the CPU backend's ops otherwise."""

    def chunked(self, q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                recompute: bool = False):
        if _on_fla(q):
            return fla_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state)
        return super().chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                               recompute=recompute)

    def recurrent(self, q, k, v, g, beta, *, scale=None, initial_state=None):
        if _on_fla(q):
            return fla_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state, decode=True)
        return super().recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def passing(self, q, k, v, g, beta, link, *, scale=None, chunk_size: int = 64, recompute: bool = False):
        """Under CP: fla's chunked kernels run widened (``megamoe.layers.ops.delta_rule.passing``;
        fla's own CP takes no initial or final state)."""
        if _on_fla(q):
            return widened_passing(self.chunked, q, k, v, g, beta, link, scale=scale, chunk_size=chunk_size,
                                   recompute=recompute)
        return super().passing(q, k, v, g, beta, link, scale=scale, chunk_size=chunk_size, recompute=recompute)


class FlaLightning(ChunkedLightning):
    """``fla_lightning`` on CUDA tensors where fla is installed, the CPU backend's ops otherwise."""

    def chunked(self, q, k, v, slope, initial_state=None, block: int = 64, resets=None):
        if _on_fla(q) and resets is None:  # packed documents: the torch form (it masks per token)
            return fla_lightning(q, k, v, slope, initial_state=initial_state)
        return super().chunked(q, k, v, slope, initial_state, block=block, resets=resets)

    def recurrent(self, q, k, v, slope, initial_state=None):
        if _on_fla(q):
            return fla_lightning(q, k, v, slope, initial_state=initial_state, decode=True)
        return super().recurrent(q, k, v, slope, initial_state)


# ---- FP8 linears and experts --------------------------------------------------------------

class FP8ColumnParallelLinear(ColumnParallelLinear):
    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


class FP8RowParallelLinear(RowParallelLinear):
    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight)


class FP8ReplicatedLinear(ReplicatedLinear):
    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


class FP8GroupedExperts(GroupedExperts):
    """Routed experts with FP8 grouped GEMMs; widths the scaled GEMM rejects run the configured
    high-precision kernel."""

    def compute(self, x, idx, counts, probs, w1, w2, out_rows, experts=None):
        out = swiglu_experts_fp8(x, idx, counts, probs, w1, w2, out_rows, self.glu)
        return out if out is not None else super().compute(x, idx, counts, probs, w1, w2, out_rows, experts)


class CudaBackend(CpuBackend):
    name = "cuda"

    def __init__(self, fusion: Fusion = EAGER, fp8: str | None = None):
        super().__init__(fusion)
        if fp8 is not None and fp8 not in FP8_RECIPES:
            raise ConfigError(f"train.fp8={fp8!r} is not available on the cuda backend: allowed: torch")
        self.fp8 = fp8

    def __repr__(self) -> str:
        return f"CudaBackend(fusion={self.fusion.mode!r}, fp8={self.fp8!r})"

    # the base roles build these classes (same arguments, only the local GEMM differs)
    @property
    def column_cls(self):
        return FP8ColumnParallelLinear if self.fp8 else ColumnParallelLinear

    @property
    def row_cls(self):
        return FP8RowParallelLinear if self.fp8 else RowParallelLinear

    @property
    def replicated_cls(self):
        return FP8ReplicatedLinear if self.fp8 else ReplicatedLinear

    @property
    def experts_fp8(self) -> bool:
        """Whether the routed experts run FP8 grouped GEMMs (``FP8GroupedExperts``)."""
        return self.fp8 is not None

    def delta_rule(self, ctx: BuildContext):
        return FlaDeltaRule(self.fusion)

    def lightning(self, ctx: BuildContext):
        return FlaLightning()

    def grouped_experts(self, ctx: BuildContext, num_experts: int, ffn_hidden_size: int, *, kernel: str = "auto",
                        active_fraction: float = 1.0, glu: GLU = SWIGLU, store=None):
        """Stacked SwiGLU experts; ``auto`` runs torch's grouped GEMM where it works (the loop
        kernel otherwise, e.g. on the CPU in the contract tests). Tiered experts (an enabled
        ``store``) come to the device through the store's side stream and run the
        high-precision kernels (FP8 copies of stored experts are not made)."""
        if self.experts_fp8 and store is not None and store.enabled:
            raise ConfigError("model.moe.expert_store with train.fp8: tiered experts run in high precision; "
                              "unset one of them")
        return self.experts_module(ctx, num_experts, ffn_hidden_size, kernel=kernel, active_fraction=active_fraction,
                                   glu=glu, store=store,
                                   cls=FP8GroupedExperts if self.experts_fp8 else GroupedExperts)
