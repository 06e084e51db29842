"""What the delta-rule mixers (GDN, KDA) share: per-head and conv parameters split over TP like
their heads, the short conv continued from the decode cache, and the delta-rule role's call (its
recurrent step while decoding, its chunked form otherwise)."""
from __future__ import annotations

import math

import torch
from torch import nn

from megamoe.layers.spec import BuildContext, ForwardInfo
from megamoe.parallel.sharding import Shard, mark_init, set_sharding


def conv_init(draw) -> torch.Tensor:
    """torch's Conv1d default for a depthwise kernel: U(-1/sqrt(K), 1/sqrt(K))."""
    bound = 1.0 / math.sqrt(draw.shape[-1])
    return draw.uniform().mul_(2).sub_(1).mul_(bound)


def head_param(ctx: BuildContext, full: int, init, parts=None) -> nn.Parameter:
    """A per-head vector split over TP like the heads it belongs to."""
    p = nn.Parameter(torch.empty(full // ctx.groups.tp_size, dtype=ctx.dtype, device=ctx.device))
    set_sharding(p, Shard(0, "tp", parts))
    return mark_init(p, init)


def conv_param(ctx: BuildContext, parts: tuple[int, ...], kernel: int) -> nn.Parameter:
    """Depthwise conv weight [channels/tp, K], channels split part by part (q | k | v)."""
    p = nn.Parameter(torch.empty(sum(parts) // ctx.groups.tp_size, kernel, dtype=ctx.dtype, device=ctx.device))
    set_sharding(p, Shard(0, "tp", parts))
    return mark_init(p, conv_init)


def log_uniform_init(low: float, high: float):
    """log(U(low, high)): the A_log init of Mamba-2, Qwen3-Next and fla."""
    return lambda draw: draw.uniform().mul_(high - low).add_(low).log_()


def conv_and_state(module: nn.Module, qkv: torch.Tensor, info: ForwardInfo):
    """Short conv over q|k|v (the module's ``conv`` role), continuing from the decode cache when
    there is one.

    Returns (conv output [b, s, C], cache dict or None, initial recurrent state or None)."""
    state = None if info.cache is None else info.cache.layer(module.layer_number)
    qkv, conv_state = module.conv(qkv, module.conv_weight, None if state is None else state.get("conv"))
    if state is not None:
        state["conv"] = conv_state
    return qkv, state, None if state is None else state.get("recurrent")


def run_delta_rule(op, q, k, v, g, beta, *, scale=None, initial_state=None, decode: bool = False,
                   chunk_size: int = 64, recompute: bool = False):
    """A backend's delta-rule role: its recurrent step while decoding, its chunked form otherwise."""
    if decode:
        return op.recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return op.chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                      recompute=recompute)
