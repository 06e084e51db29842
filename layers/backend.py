"""Backends fill the roles blocks ask for. ``local`` is pure torch and runs anywhere.

A block never branches on parallelism or on the backend: it asks ``ctx.backend`` for a
column-parallel linear, a row-parallel linear, a norm or a core attention and uses what
it gets. A Transformer Engine backend implements the same methods with TE modules (FP8).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.errors import ConfigError
from megamoe.fusion import EAGER, Fusion
from megamoe.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from megamoe.spec import BuildContext
from megamoe.layers.experts import GroupedExperts
from megamoe.layers.norm import RMSNorm, ShardedRMSNorm


def causal_mask(t_q: int, t_k: int, window: int = 0, device=None) -> torch.Tensor:
    """[t_q, t_k] bool, True = may attend. Queries are the last t_q of the t_k positions;
    ``window`` > 0 limits each query to the last ``window`` keys (itself included)."""
    q = torch.arange(t_k - t_q, t_k, device=device).unsqueeze(1)
    k = torch.arange(t_k, device=device).unsqueeze(0)
    allowed = k <= q
    if window > 0:
        allowed &= k > q - window
    return allowed


class CoreAttention(nn.Module):
    """Causal softmax attention with GQA and an optional sliding window.

    q: [b, t, hq, d], k: [b, tk, hk, d], v: [b, tk, hk, dv] -> [b, t, hq, dv]; tk >= t and the
    queries are the last t positions (decoding with a cache).
    """

    def __init__(self, softmax_scale: float, window: int = 0):
        super().__init__()
        self.scale, self.window = softmax_scale, window

    def forward(self, q, k, v, mask: torch.Tensor | None = None):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, t, d]
        t, tk = q.size(2), k.size(2)
        gqa = q.size(1) != k.size(1)
        if mask is None and self.window == 0 and t == tk:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            if mask is None:
                mask = causal_mask(t, tk, self.window, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return out.transpose(1, 2)


class LocalBackend:
    """Pure-torch roles over the groups in ``ctx``. ``fusion``: this backend's policy for the
    fused elementwise kernels of its roles and of the ops its layers run (``megamoe.fusion``)."""

    name = "local"

    def __init__(self, fusion: Fusion = EAGER):
        self.fusion = fusion

    def column_linear(self, ctx: BuildContext, in_features: int, out_features: int | Sequence[int], *,
                      bias: bool = False, gather_output: bool = False, sequence_parallel: bool | None = None,
                      group: str = "tp", init_std: float | None = None) -> nn.Module:
        sp = ctx.sp if sequence_parallel is None else sequence_parallel
        return ColumnParallelLinear(in_features, out_features, getattr(ctx.groups, group), bias=bias,
                                    gather_output=gather_output, sequence_parallel=sp,
                                    init_std=init_std or ctx.init_std, dtype=ctx.dtype, device=ctx.device,
                                    group_name=group)

    def row_linear(self, ctx: BuildContext, in_features: int | Sequence[int], out_features: int, *,
                   bias: bool = False, sequence_parallel: bool | None = None, group: str = "tp",
                   init_std: float | None = None) -> nn.Module:
        sp = ctx.sp if sequence_parallel is None else sequence_parallel
        std = init_std or ctx.init_std / (2.0 * ctx.num_layers) ** 0.5  # output projections: scaled init
        return RowParallelLinear(in_features, out_features, getattr(ctx.groups, group), bias=bias,
                                 sequence_parallel=sp, init_std=std, dtype=ctx.dtype, device=ctx.device,
                                 group_name=group)

    def replicated_linear(self, ctx: BuildContext, in_features: int, out_features: int, *, bias: bool = False,
                          sequence_parallel: bool | None = None, init_std: float | None = None) -> nn.Module:
        """A linear every TP rank holds whole (see ``ReplicatedLinear`` for the gradient contract)."""
        sp = ctx.sp if sequence_parallel is None else sequence_parallel
        return ReplicatedLinear(in_features, out_features, ctx.groups.tp, bias=bias, sequence_parallel=sp,
                                init_std=init_std or ctx.init_std, dtype=ctx.dtype, device=ctx.device)

    def sharded_norm(self, ctx: BuildContext, full_dim: int, *, eps: float | None = None) -> nn.Module:
        """RMSNorm over a dim split over TP (statistics all-reduced); weight ones."""
        return ShardedRMSNorm(full_dim, ctx.groups.tp, ctx.norm_eps if eps is None else eps,
                              dtype=ctx.dtype, device=ctx.device)

    def norm(self, ctx: BuildContext, dim: int, *, sequence_parallel: bool = False, head_sharded: bool = False,
             eps: float | None = None, zero_centered: bool | None = None) -> nn.Module:
        """RMSNorm. ``sequence_parallel``: applied to the residual stream (a sequence shard under
        SP); ``head_sharded``: applied to this TP rank's heads only (QK-norm)."""
        partial = (sequence_parallel and ctx.sp) or (head_sharded and ctx.groups.tp_size > 1)
        return RMSNorm(dim, ctx.norm_eps if eps is None else eps,
                       ctx.norm_zero_centered if zero_centered is None else zero_centered,
                       tp_partial_grad=partial, dtype=ctx.dtype, device=ctx.device, fusion=self.fusion)

    def core_attention(self, ctx: BuildContext, *, softmax_scale: float, window: int = 0) -> nn.Module:
        return CoreAttention(softmax_scale, window)

    def grouped_experts(self, ctx: BuildContext, num_experts: int, ffn_hidden_size: int, *, kernel: str = "auto",
                        active_fraction: float = 1.0, swiglu_limit: float | None = None) -> nn.Module:
        """Stacked SwiGLU experts sharded over ep/etp (``megamoe.layers.experts.GroupedExperts``)."""
        return GroupedExperts(ctx, num_experts, ffn_hidden_size, kernel=kernel, active_fraction=active_fraction,
                              swiglu_limit=swiglu_limit, fusion=self.fusion)


BACKENDS = {"local": LocalBackend}


def get_backend(name: str, fusion: Fusion = EAGER):
    """A new backend instance; it owns ``fusion`` (nothing about it is process-wide)."""
    if name not in BACKENDS:
        raise ConfigError(f"model.backend={name!r} is not available in this build: allowed: "
                          f"{', '.join(BACKENDS)}")
    return BACKENDS[name](fusion)
