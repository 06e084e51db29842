"""L2 normalisation over the last dim (the linear mixers' q/k norm, the ``l2_norm`` role): a
fused form with a hand-written backward and its reference in plain autograd ops."""
from __future__ import annotations

import torch

from megamoe.layers.ops.fusion import call, fused


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
