"""Pieces the delta-rule mixers share: per-head and conv parameters, short causal conv with
decode state, L2 norm, the delta-rule role's call (its recurrent step or chunked form).

Shapes: x [b, t, channels]; conv weight [channels, kernel]; conv state [b, kernel - 1, channels]
(the last inputs seen, oldest first).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.layers.ops.fusion import call, fused
from megamoe.parallel.sharding import Shard, mark_init, set_sharding
from megamoe.layers.spec import BuildContext, ForwardInfo


@fused
def _conv_silu_fused(x, taps):
    """Fused forward: x [b, t, c], taps [K, c] -> (silu(pre), pre) [b, t, c] each."""
    kernel, t = taps.size(0), x.size(1)
    xp = F.pad(x, (0, 0, kernel - 1, 0))  # tap j reads x_{t - (K-1-j)}
    pre = xp[:, :t] * taps[0]
    for j in range(1, kernel):
        pre = pre + xp[:, j:j + t] * taps[j]
    return F.silu(pre), pre


@fused
def _conv_silu_fused_backward(dy, x, taps, pre):
    """Fused backward -> (dx [b, t, c], dtaps [K, c])."""
    kernel, t = taps.size(0), x.size(1)
    sig = torch.sigmoid(pre)
    dpre = dy * sig * (1 + pre * (1 - sig))
    ahead = F.pad(dpre, (0, 0, 0, kernel - 1))  # dx_t = sum_j dpre_{t + K-1-j} taps_j
    dx = ahead[:, :t] * taps[kernel - 1]
    for j in range(kernel - 1):
        dx = dx + ahead[:, kernel - 1 - j:kernel - 1 - j + t] * taps[j]
    xp = F.pad(x, (0, 0, kernel - 1, 0))
    return dx, torch.stack([(dpre * xp[:, j:j + t]).sum((0, 1)) for j in range(kernel)])


class _CausalConvSiLU(torch.autograd.Function):
    """silu(depthwise causal conv) from a zero state, as K shifted multiply-adds over [b, t, c]
    (channels last, no transposes, no padded copy: tap K-1-s reads the input s steps back).
    Saves the input and the pre-activation (recomputing it took a fifth of the backward).
    torch's depthwise conv1d backward took ~10x longer on CPU. One fused pass each way where
    ``fuse`` (see ``megamoe.layers.ops.fusion``)."""

    @staticmethod
    def _pre(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """taps [K, c] (contiguous rows) -> pre-activation [b, t, c]."""
        kernel, t = taps.size(0), x.size(1)
        pre = x * taps[kernel - 1]
        for s in range(1, min(kernel, t + 1)):
            pre[:, s:].addcmul_(x[:, :t - s], taps[kernel - 1 - s])
        return pre

    @staticmethod
    def forward(ctx, x, weight, fuse):
        ctx.fuse = fuse
        taps = weight.t().contiguous()
        if ctx.fuse:
            y, pre = _conv_silu_fused(x, taps)
            ctx.save_for_backward(x, taps, pre)
            return y
        pre = _CausalConvSiLU._pre(x, taps)
        ctx.save_for_backward(x, taps, pre)
        return F.silu(pre)

    @staticmethod
    def backward(ctx, dy):
        x, taps, pre = ctx.saved_tensors
        if ctx.fuse:
            dx, dtaps = _conv_silu_fused_backward(dy, x, taps, pre)
            return dx, dtaps.t(), None
        kernel, t = taps.size(0), x.size(1)
        dpre = torch.ops.aten.silu_backward(dy, pre)
        dx = dpre * taps[kernel - 1]
        dtaps = torch.zeros_like(taps)
        dtaps[kernel - 1] = (dpre * x).sum((0, 1))
        for s in range(1, min(kernel, t + 1)):
            dx[:, :t - s].addcmul_(dpre[:, s:], taps[kernel - 1 - s])
            dtaps[kernel - 1 - s] = (dpre[:, s:] * x[:, :t - s]).sum((0, 1))
        return dx, dtaps.t(), None


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, fuse: bool = False):
    """Depthwise causal conv followed by SiLU. x [b, t, c], weight [c, K], state [b, K-1, c] or None
    (zeros: the start of a sequence) -> (y [b, t, c], new state [b, K-1, c]). ``fuse``: the
    training form runs its fused kernels (``megamoe.layers.ops.fusion``)."""
    t, kernel = x.size(1), weight.size(-1)
    if state is None and torch.is_grad_enabled():
        y = _CausalConvSiLU.apply(x, weight, fuse)
        return y, F.pad(x[:, max(0, t - (kernel - 1)):], (0, 0, max(0, kernel - 1 - t), 0))
    if state is not None and t == 1:
        return causal_conv_step(x, weight, state)
    return causal_conv_reference(x, weight, state)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor):
    """One decode step of ``causal_conv``: x [b, 1, c], state [b, K-1, c] -> (y [b, 1, c], new state).
    The window times the taps, summed over K: four small ops where torch's conv1d paid a
    convolution primitive's setup (and two transposes) for K multiply-adds per channel."""
    full = torch.cat([state.to(x.dtype), x], dim=1)                       # [b, K, c]
    pre = torch.linalg.vecdot(full.transpose(1, 2), weight).unsqueeze(1)  # [b, 1, c]
    return F.silu(pre), full[:, 1:]


def causal_conv_reference(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None):
    """``causal_conv`` as torch's depthwise conv1d over [state | x] (plain autograd)."""
    b, t, c = x.shape
    kernel = weight.size(-1)
    if state is None:
        state = x.new_zeros(b, kernel - 1, c)
    full = torch.cat([state.to(x.dtype), x], dim=1)                  # [b, K-1+t, c]
    y = F.conv1d(full.transpose(1, 2), weight.unsqueeze(1), groups=c)  # [b, c, t]
    return F.silu(y.transpose(1, 2)), full[:, full.size(1) - (kernel - 1):]


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


@fused
def _l2norm_fused(x, eps: float, scale: float, heads_first: bool):
    """Fused forward -> (scale x / norm in fp32 at least, 1/norm [..., 1])."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
    y = xf * (rstd * scale)
    if heads_first:  # stored [b, h, t, d], returned as the [b, t, h, d] view of it
        y = y.transpose(1, 2).contiguous().transpose(1, 2)
    return y, rstd


@fused
def _l2norm_fused_backward(dy, x, rstd, scale: float):
    y = x.to(rstd.dtype) * rstd
    return (dy - y * (dy * y).sum(-1, keepdim=True)) * (rstd * scale)


class _L2Norm(torch.autograd.Function):
    """Saves x and 1/norm only; y = scale x / norm, dx = scale (dy - y' sum(dy y')) / norm with
    y' = x / norm. One fused pass each way with ``fuse`` (see ``megamoe.layers.ops.fusion``)."""

    @staticmethod
    def run(x, eps, scale, heads_first, fuse):
        """The forward's maths -> (y, 1/norm); called directly where nothing needs a gradient."""
        if fuse:
            return _l2norm_fused(x, eps, scale, heads_first)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
        scaled = rstd * scale if scale != 1.0 else rstd
        if not heads_first:
            return xf * scaled, rstd
        b, t, h, d = x.shape  # the same values, stored [b, h, t, d] (what the chunked op reads)
        out = torch.empty(b, h, t, d, dtype=xf.dtype, device=x.device).transpose(1, 2)
        return torch.mul(xf, scaled, out=out), rstd

    @staticmethod
    def forward(ctx, x, eps, scale, heads_first, fuse):
        ctx.scale, ctx.fuse = scale, fuse
        y, rstd = _L2Norm.run(x, eps, scale, heads_first, fuse)
        ctx.save_for_backward(x, rstd)  # x as given: bf16 stays bf16
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        if ctx.fuse:
            return _l2norm_fused_backward(dy, x, rstd, ctx.scale), None, None, None, None
        y = x.to(rstd.dtype) * rstd
        dx = rstd * (dy - y * (dy * y).sum(-1, keepdim=True))
        return (dx if ctx.scale == 1.0 else dx * ctx.scale), None, None, None, None


def l2norm(x: torch.Tensor, eps: float = 1e-6, scale: float = 1.0, heads_first: bool = False,
           fuse: bool = False) -> torch.Tensor:
    """scale * x / sqrt(sum x^2 + eps) over the last dim, in fp32 (as fla and the HF references).
    ``heads_first``: x [b, t, h, d], the result stored as [b, h, t, d] (a transposed view),
    so the chunked delta rule reads it without another copy."""
    return call(_L2Norm, x, eps, scale, heads_first, fuse)


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6, scale: float = 1.0, heads_first: bool = False
                     ) -> torch.Tensor:
    """``l2norm``'s values in plain autograd ops (``heads_first`` is a storage hint it ignores)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps) * scale


def run_delta_rule(op, q, k, v, g, beta, *, scale=None, initial_state=None, decode: bool = False,
                   chunk_size: int = 64, recompute: bool = False):
    """A backend's delta-rule role: its recurrent step while decoding, its chunked form otherwise."""
    if decode:
        return op.recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return op.chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                      recompute=recompute)
