"""The roles every backend shares: pure-torch layers with no faster CPU form (the parallel
linears, the sharded norm, softmax attention through torch's SDPA, the MLA and DSA latent
cores, the router GEMM). ``local`` and ``cpu`` both inherit them; a GPU backend overrides
what it accelerates."""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from megamoe.layers.spec import BuildContext
from megamoe.layers.mixers.block_sparse import block_sparse_attention
from megamoe.layers.ops.attention.core import CoreAttention
from megamoe.layers.ops.attention.tiles import MATH
from megamoe.layers.mixers.dsa import sparse_latent_attention
from megamoe.layers.mlp.experts import GroupedExperts, reference_kernel
from megamoe.layers.ops.fp8.frozen import dequantize_rows, frozen_linear
from megamoe.layers.mlp.stored_experts import StoredExperts
from megamoe.layers.mixers.mla import latent_attention
from megamoe.layers.mlp.dense import GLU
from megamoe.layers.ops.compressed_attention import chunk_compressed_attention
from megamoe.layers.norm import ShardedRMSNorm


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, h], weight [E, h] -> fp32 logits [T, E] (routing is decided in fp32)."""
    return F.linear(x.float(), weight.float())


class BaseBackend:
    """Shared roles; subclasses add the kernel-bearing ones. ``fusion``: the instance's policy
    for compiled elementwise kernels (``megamoe.layers.ops.fusion``)."""

    name = "base"
    # the classes the linear roles build (a backend with another local GEMM overrides them)
    column_cls, row_cls, replicated_cls = ColumnParallelLinear, RowParallelLinear, ReplicatedLinear
    # the routed experts' kernel for model.moe.expert_kernel='auto': (device, dtype) -> a kernel name
    auto_expert_kernel = staticmethod(reference_kernel)

    def __init__(self, fusion: Fusion = EAGER):
        self.fusion = fusion

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fusion={self.fusion.mode!r})"

    # ---- linears ------------------------------------------------------------------------

    def column_linear(self, ctx: BuildContext, in_features: int, out_features: int | Sequence[int], *,
                      bias: bool = False, gather_output: bool = False, sequence_parallel: bool | None = None,
                      group: str = "tp", init_std: float | None = None) -> nn.Module:
        sp = ctx.sp if sequence_parallel is None else sequence_parallel
        return self.column_cls(in_features, out_features, getattr(ctx.groups, group), bias=bias,
                                    gather_output=gather_output, sequence_parallel=sp,
                                    init_std=init_std or ctx.init_std, dtype=ctx.dtype, device=ctx.device,
                                    group_name=group)

    def row_linear(self, ctx: BuildContext, in_features: int | Sequence[int], out_features: int, *,
                   bias: bool = False, sequence_parallel: bool | None = None, group: str = "tp",
                   init_std: float | None = None) -> nn.Module:
        sp = ctx.sp if sequence_parallel is None else sequence_parallel
        std = init_std or ctx.init_std / (2.0 * ctx.num_layers) ** 0.5  # output projections: scaled init
        return self.row_cls(in_features, out_features, getattr(ctx.groups, group), bias=bias,
                                 sequence_parallel=sp, init_std=std, dtype=ctx.dtype, device=ctx.device,
                                 group_name=group)

    def replicated_linear(self, ctx: BuildContext, in_features: int, out_features: int, *, bias: bool = False,
                          sequence_parallel: bool | None = None, init_std: float | None = None) -> nn.Module:
        """A linear every TP rank holds whole (see ``ReplicatedLinear`` for the gradient contract)."""
        sp = ctx.sp if sequence_parallel is None else sequence_parallel
        return self.replicated_cls(in_features, out_features, ctx.groups.tp, bias=bias, sequence_parallel=sp,
                                init_std=init_std or ctx.init_std, dtype=ctx.dtype, device=ctx.device)

    # ---- norms and attention cores --------------------------------------------------------

    def sharded_norm(self, ctx: BuildContext, full_dim: int, *, eps: float | None = None) -> nn.Module:
        """RMSNorm over a dim split over TP (statistics all-reduced); weight ones."""
        return ShardedRMSNorm(full_dim, ctx.groups.tp, ctx.norm_eps if eps is None else eps,
                              dtype=ctx.dtype, device=ctx.device)

    def core_attention(self, ctx: BuildContext, *, softmax_scale: float, window: int = 0) -> nn.Module:
        """Causal softmax attention with GQA and an optional sliding window (``CoreAttention``);
        under CP its ring runs ``attention_tiles``."""
        return CoreAttention(softmax_scale, window, self.attention_tiles())

    def attention_tiles(self):
        """The tile kernel of ring attention (``megamoe.layers.ops.attention.tiles``): here the
        math reference, fp32 scores per tile of at most TILE x TILE tokens."""
        return MATH

    def latent_attention(self, ctx: BuildContext):
        """MLA's absorbed attention over cached latents (``megamoe.layers.mixers.mla.latent_attention``)."""
        return latent_attention

    def block_sparse_attention(self, ctx: BuildContext):
        """Letter B's attention over each query's kept keys (``megamoe.layers.mixers.block_sparse``):
        (q [b, s, H, d], k, v [b, T, G, d], tok [b, s, G, N], scale) -> [b, s, H, d]."""
        return block_sparse_attention

    def compressed_attention(self, ctx: BuildContext):
        """DeepSeek-V4's attention over a sliding window, compressed entries and a sink, in query
        tiles (``megamoe.layers.ops.compressed_attention.chunk_compressed_attention``)."""
        return chunk_compressed_attention

    def sparse_latent_attention(self, ctx: BuildContext):
        """DSA's attention over the indexer's selection (``megamoe.layers.mixers.dsa.sparse_latent_attention``)."""
        return sparse_latent_attention

    # ---- routed experts -----------------------------------------------------------------------

    def experts_module(self, ctx: BuildContext, num_experts: int, ffn_hidden_size: int, *, kernel: str,
                       active_fraction: float, glu: GLU, store=None, cls=GroupedExperts):
        """``cls`` (the backend's experts class) with resident weights, or ``StoredExperts`` when
        ``store`` (``ExpertStoreConfig``) is enabled: the weights then stay in the expert store
        and come in when routed to (``megamoe.expert_store``)."""
        kw = dict(kernel=kernel, active_fraction=active_fraction, glu=glu, fusion=self.fusion,
                  auto_kernel=self.auto_expert_kernel)
        if store is not None and store.enabled:
            return StoredExperts(ctx, num_experts, ffn_hidden_size, store=store, **kw)
        return cls(ctx, num_experts, ffn_hidden_size, **kw)

    # ---- frozen FP8 weights (megamoe.model.fp8_base) -----------------------------------------------

    def frozen_fp8_linear(self, ctx: BuildContext):
        """(x, q, scale, col_block, bias) -> y through a frozen e4m3 weight (``megamoe.layers.ops.fp8.frozen``):
        dequantised per GEMM, here and on the GPU (the dequantise-on-the-fly form)."""
        return frozen_linear

    def frozen_fp8_weight(self, ctx: BuildContext):
        """(q, scale, col_block, dtype) -> the dequantised weight (routed experts, absorbed MLA)."""
        return dequantize_rows

    # ---- around a forward -----------------------------------------------------------------

    def stage_context(self, groups):
        """The context a pipeline stage's forward runs in (``groups``: its ``ParallelGroups``);
        none here. The te backend opens its FP8 autocast there, once per stage forward."""
        return contextlib.nullcontext()

    def router_logits(self, ctx: BuildContext):
        """The router GEMM: (x [T, h], weight [E, h]) -> fp32 logits [T, E]."""
        return router_logits
