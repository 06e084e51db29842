"""Short causal depthwise convolution with decode state (the linear mixers' ``short_conv`` role),
and SiLU after it: a fused form with a hand-written backward, a step for decoding, a reference.

Shapes: x [b, t, channels]; conv weight [channels, kernel]; conv state [b, kernel - 1, channels]
(the last inputs seen, oldest first).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.layers.ops.fusion import fused


def _padded(x, taps, state):
    """[state | x] [b, K-1+t, c]: the inputs each output reads (zeros for no state)."""
    if state is None:
        return F.pad(x, (0, 0, taps.size(0) - 1, 0))
    return torch.cat([state.to(x.dtype), x], dim=1)


@fused
def _conv_silu_fused(x, taps, state):
    """Fused forward: x [b, t, c], taps [K, c], state [b, K-1, c] or None -> (silu(pre), pre) [b, t, c] each."""
    kernel, t = taps.size(0), x.size(1)
    xp = _padded(x, taps, state)  # tap j reads x_{t - (K-1-j)}
    pre = xp[:, :t] * taps[0]
    for j in range(1, kernel):
        pre = pre + xp[:, j:j + t] * taps[j]
    return F.silu(pre), pre


@fused
def _conv_silu_fused_backward(dy, x, taps, pre, state):
    """Fused backward -> (dx [b, t, c], dtaps [K, c], dstate [b, K-1, c] or None)."""
    kernel, t = taps.size(0), x.size(1)
    sig = torch.sigmoid(pre)
    dpre = dy * sig * (1 + pre * (1 - sig))
    # d[state | x]_u = sum_j dpre_{u - j} taps_j
    around = F.pad(dpre, (0, 0, kernel - 1, kernel - 1))
    dxp = around[:, kernel - 1:kernel - 1 + t + kernel - 1] * taps[0]
    for j in range(1, kernel):
        dxp = dxp + around[:, kernel - 1 - j:2 * kernel - 2 - j + t] * taps[j]
    xp = _padded(x, taps, state)
    dtaps = torch.stack([(dpre * xp[:, j:j + t]).sum((0, 1)) for j in range(kernel)])
    return dxp[:, kernel - 1:], dtaps, None if state is None else dxp[:, :kernel - 1]


class _CausalConvSiLU(torch.autograd.Function):
    """silu(depthwise causal conv) from ``state`` (the K-1 inputs before x; None: zeros), as K
    shifted multiply-adds over [b, t, c] (channels last, no transposes, no padded copy of x in
    the eager form: tap K-1-s reads the input s steps back, the state for the first s outputs).
    Saves the input, the state and the pre-activation (recomputing it took a fifth of the
    backward). torch's depthwise conv1d backward took ~10x longer on CPU. One fused pass each
    way where ``fuse`` (see ``megamoe.layers.ops.fusion``)."""

    @staticmethod
    def _pre(x: torch.Tensor, taps: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """taps [K, c] (contiguous rows) -> pre-activation [b, t, c]."""
        kernel, t = taps.size(0), x.size(1)
        pre = x * taps[kernel - 1]
        for s in range(1, kernel):
            if s <= t:
                pre[:, s:].addcmul_(x[:, :t - s], taps[kernel - 1 - s])
            if state is not None:  # outputs 0 .. s-1 read state[K-1-s+j]
                m = min(s, t)
                pre[:, :m].addcmul_(state[:, kernel - 1 - s:kernel - 1 - s + m], taps[kernel - 1 - s])
        return pre

    @staticmethod
    def forward(ctx, x, weight, state, fuse):
        ctx.fuse = fuse
        taps = weight.t().contiguous()
        state = None if state is None else state.to(x.dtype)
        if ctx.fuse:
            y, pre = _conv_silu_fused(x, taps, state)
        else:
            pre = _CausalConvSiLU._pre(x, taps, state)
            y = F.silu(pre)
        ctx.save_for_backward(x, taps, pre, state)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, taps, pre, state = ctx.saved_tensors
        if ctx.fuse:
            dx, dtaps, dstate = _conv_silu_fused_backward(dy, x, taps, pre, state)
            return dx, dtaps.t(), dstate, None
        kernel, t = taps.size(0), x.size(1)
        dpre = torch.ops.aten.silu_backward(dy, pre)
        dx = dpre * taps[kernel - 1]
        dtaps = torch.zeros_like(taps)
        dtaps[kernel - 1] = (dpre * x).sum((0, 1))
        dstate = None if state is None else torch.zeros_like(state)
        for s in range(1, kernel):
            if s <= t:
                dx[:, :t - s].addcmul_(dpre[:, s:], taps[kernel - 1 - s])
                dtaps[kernel - 1 - s] = (dpre[:, s:] * x[:, :t - s]).sum((0, 1))
            if state is not None:
                m, lo = min(s, t), kernel - 1 - s
                dstate[:, lo:lo + m].addcmul_(dpre[:, :m], taps[lo])
                dtaps[lo] += (dpre[:, :m] * state[:, lo:lo + m]).sum((0, 1))
        return dx, dtaps.t(), dstate, None


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None, fuse: bool = False):
    """Depthwise causal conv followed by SiLU. x [b, t, c], weight [c, K], state [b, K-1, c] or None
    (zeros: the start of a sequence) -> (y [b, t, c], new state [b, K-1, c]). ``fuse``: the
    training form runs its fused kernels (``megamoe.layers.ops.fusion``)."""
    t, kernel = x.size(1), weight.size(-1)
    if state is not None and t == 1:
        return causal_conv_step(x, weight, state)
    if torch.is_grad_enabled():  # training (a CP chunk from its halo too): the hand-written backward
        y = _CausalConvSiLU.apply(x, weight, state, fuse)
        tail = x[:, max(0, t - (kernel - 1)):]
        return y, _padded(tail, weight.t(), state)[:, tail.size(1):]
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
