"""RMSNorm, plain (``w * x̂``) or zero-centred (``(1 + w) * x̂``, weight stored around 0).

Two kernels with one contract ``(x, weight, eps, zero_centered, gate, act) -> y``:
``rms_norm_reference`` (plain autograd ops, the local backend's) and ``HandwrittenRMSNorm``
(a hand-written backward saving only x, the gate and 1/rms, fused per its ``Fusion``; the CPU
backend's). ``RMSNorm`` holds the weight and calls the kernel its backend gave it.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.layers.ops.fusion import EAGER, Fusion, call, fused
from megamoe.parallel import comm
from megamoe.parallel.groups import group_size
from megamoe.parallel.sharding import Shard, const_init, mark_init, mark_tp_partial_grad, set_sharding


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in fp32, returned in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


_GATES = {"silu": (torch.nn.functional.silu, torch.ops.aten.silu_backward),
          "sigmoid": (torch.sigmoid, lambda dy, g: dy * torch.sigmoid(g) * (1 - torch.sigmoid(g)))}


def _gate_grad(dy, gate, act: str):
    """d act(gate) / d gate times dy, from the gate alone (fp32)."""
    sig = torch.sigmoid(gate)
    return dy * sig * (1 + gate * (1 - sig)) if act == "silu" else dy * sig * (1 - sig)


@fused
def _norm_fused(x, weight, gate, eps: float, zero_centered: bool, act: str):
    """Fused forward -> (out in x's dtype, 1/rms [..., 1] fp32 at least)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(dtype) + 1.0 if zero_centered else weight.to(dtype)
    out = xf * rstd * w
    if gate is not None:
        out = out * _GATES[act][0](gate.to(dtype))
    return out.to(x.dtype), rstd


@fused
def _norm_fused_backward(dy, x, weight, rstd, gate, zero_centered: bool, act: str):
    """Fused backward -> (dx, dweight, dgate | None) in their inputs' dtypes."""
    dtype = rstd.dtype
    w = weight.to(dtype) + 1.0 if zero_centered else weight.to(dtype)
    xhat = x.to(dtype) * rstd
    dn = dy.to(dtype)
    dgate = None
    if gate is not None:
        gf = gate.to(dtype)
        dgate = _gate_grad(dn * xhat * w, gf, act).to(gate.dtype)
        dn = dn * _GATES[act][0](gf)
    dweight = (dn * xhat).reshape(-1, xhat.size(-1)).sum(0).to(weight.dtype)
    dxhat = dn * w
    dx = (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True)) * rstd
    return dx.to(x.dtype), dweight, dgate


class _RMSNormFn(torch.autograd.Function):
    """w * x / rms(x) [* act(gate)] in fp32, saving only x, the gate and 1/rms for the backward
    (the unfused form keeps x, x / rms, the gate and its activation). One fused pass each way
    with ``fuse`` (see ``megamoe.layers.ops.fusion``)."""

    @staticmethod
    def run(x, weight, eps, zero_centered, gate, act, fuse):
        """The forward's maths -> (out in x's dtype, 1/rms); called directly where nothing
        needs a gradient (decoding: no autograd node per norm)."""
        if fuse:
            return _norm_fused(x, weight, gate, eps, zero_centered, act)
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least
        xf = x.to(dtype)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        w = weight.to(dtype) + 1.0 if zero_centered else weight.to(dtype)
        out = (xf * rstd).mul_(w)
        if gate is not None:
            out.mul_(_GATES[act][0](gate.to(dtype)))
        return out.to(x.dtype), rstd

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered, gate, act, fuse):
        ctx.zero_centered, ctx.act, ctx.fuse = zero_centered, act, fuse
        out, rstd = _RMSNormFn.run(x, weight, eps, zero_centered, gate, act, fuse)
        ctx.save_for_backward(x, weight, rstd, gate)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd, gate = ctx.saved_tensors
        if ctx.fuse:
            dx, dweight, dgate = _norm_fused_backward(dy, x, weight, rstd, gate, ctx.zero_centered, ctx.act)
            return dx, dweight, None, None, dgate, None, None
        dtype = rstd.dtype
        w = weight.to(dtype) + 1.0 if ctx.zero_centered else weight.to(dtype)
        xhat = x.to(dtype) * rstd
        dn = dy.to(dtype)
        dgate = None
        if gate is not None:
            fn, fn_backward = _GATES[ctx.act]
            gf = gate.to(dtype)
            dgate = fn_backward(dn * xhat * w, gf).to(gate.dtype)
            dn = dn * fn(gf)
        dweight = (dn * xhat).reshape(-1, xhat.size(-1)).sum(0).to(weight.dtype)
        dxhat = dn * w
        mean = torch.linalg.vecdot(dxhat, xhat).unsqueeze_(-1).div_(xhat.size(-1))
        dx = torch.addcmul(dxhat, xhat, mean, value=-1.0).mul_(rstd)  # rstd (dxhat - xhat mean)
        return dx.to(x.dtype), dweight, None, None, dgate, None, None


def rms_norm_reference(x, weight, eps: float, zero_centered: bool, gate=None, act: str = "silu"):
    """The definition in plain autograd ops: w * x / rms(x) [* act(gate)], fp32 inside (float64
    stays float64), the result in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    w = weight.to(dtype) + 1.0 if zero_centered else weight.to(dtype)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
    if gate is not None:
        out = out * _GATES[act][0](gate.to(dtype))
    return out.to(x.dtype)


class HandwrittenRMSNorm:
    """``_RMSNormFn`` as a kernel, fused where ``fusion`` is active for the input's device."""

    def __init__(self, fusion: Fusion = EAGER):
        self.fusion = fusion

    def __call__(self, x, weight, eps: float, zero_centered: bool, gate=None, act: str = "silu"):
        return call(_RMSNormFn, x, weight, eps, zero_centered, gate, act, self.fusion.active(x.device))


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; statistics in fp32 whatever the input dtype.

    ``tp_partial_grad``: the weight is replicated over TP but sees only part of the work
    (a sequence shard under SP, or one rank's heads), so ``finalize_grads`` sums its
    gradient over TP. ``kernel``: the building backend's (default: the hand-written one, eager).
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False, *,
                 tp_partial_grad: bool = False, dtype=None, device=None, kernel=None):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.kernel = kernel or HandwrittenRMSNorm()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        mark_init(self.weight, const_init(0.0 if zero_centered else 1.0))
        if tp_partial_grad:
            mark_tp_partial_grad(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None, gate_act: str = "silu") -> torch.Tensor:
        """x [..., dim] -> same; with ``gate`` (x's shape): the gated norm of the linear mixers'
        outputs, ``norm(x) * act(gate)`` with act ``silu`` (Qwen3-Next) or ``sigmoid`` (KDA)."""
        return self.kernel(x, self.weight, self.eps, self.zero_centered, gate, gate_act)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, zero_centered={self.zero_centered}"


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a last dim that is split over ``group`` (a norm over all heads when TP
    holds some of them, e.g. MiniMax lightning attention's output norm).

    x: [..., full_dim / tp] -> same. The sum of squares is all-reduced in the forward and its
    gradient in the backward (each rank normalises its own channels by the shared statistic).
    The weight is split like x.
    """

    def __init__(self, full_dim: int, group=None, eps: float = 1e-6, *, dtype=None, device=None):
        super().__init__()
        self.group, self.full_dim, self.eps = group, full_dim, eps
        self.weight = nn.Parameter(torch.empty(full_dim // group_size(group), dtype=dtype, device=device))
        set_sharding(self.weight, Shard(0, "tp"))
        mark_init(self.weight, const_init(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sumsq = xf.pow(2).sum(-1, keepdim=True)
        # all-reduce forward and backward: copy_to (backward all-reduce) then reduce_from
        sumsq = comm.reduce_from(comm.copy_to(sumsq, self.group), self.group)
        out = xf * torch.rsqrt(sumsq / self.full_dim + self.eps) * self.weight.float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.full_dim} (local {self.weight.numel()}), eps={self.eps}"
