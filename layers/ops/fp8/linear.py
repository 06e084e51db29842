"""FP8 GEMMs with row-wise scales through torch's scaled matmuls (``train.fp8=torch``).

The recipe (torchao calls it "rowwise with high-precision weight gradient")::

    forward  y  = x W^T    x: e4m3, one scale per token row     W: e4m3, one scale per output row
    dgrad    dx = dy W     dy: e4m3, one scale per token row    W: e4m3, one scale per input column
    wgrad    dW = dy^T x   in the input dtype (bf16 on GPU)

Each scale is amax / 448 over the contraction dimension, so every row (or column) uses the
whole e4m3 range and one outlier token cannot flatten the others. The weight gradient stays
in high precision because its contraction runs over tokens, where activations have their
outliers; it is a third of the GEMM work.

Shapes: x [..., K] (flattened to [M, K]), W [N, K] (nn.Linear layout), y [..., N].
``torch._scaled_mm`` wants K and N to be multiples of 16 on CUDA; other widths, and
tensors that need no gradient through an FP8 path of their own, run the plain GEMM.
The CPU build of torch runs ``_scaled_mm`` too, which is what the CPU tests exercise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
_TINY = 1e-12                     # an all-zero row gets scale 1e-12/448 instead of 0


def quantize(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 dequantisation scale) with one scale per slice along ``dim``
    (the contraction dimension): t ~= q.float() * scale, scale keeps ``dim`` as size 1."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float().clamp_min(_TINY)
    scale = amax / E4M3_MAX
    q = (t.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def fp8_shapes_ok(k: int, n: int) -> bool:
    """Widths the scaled GEMM accepts (multiples of 16 in both)."""
    return k % 16 == 0 and n % 16 == 0


def scaled_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [K, N] in e4m3, a scaled per row and b per column -> [M, N] out_dtype.

    The scaled GEMM wants ``a`` row-major and ``b`` column-major, fp32 scales of shape
    [M, 1] and [1, N] and (row-wise on CUDA) a bf16 result."""
    aq, sa = quantize(a, dim=1)                    # [M, K], [M, 1]
    bq, sb = quantize(b, dim=0)                    # [K, N], [1, N]
    bq = bq.t().contiguous().t()                   # column-major
    y = torch._scaled_mm(aq.contiguous(), bq, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return y.to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with FP8 forward and input-gradient GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        x2 = x.reshape(-1, x.size(-1))                                 # [M, K]
        y = scaled_mm(x2, weight.t(), x.dtype)                         # [M, N]
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.size(-1))                              # [M, N]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm(dy2, weight, x.dtype).view_as(x)            # [M, N] @ [N, K]
        if ctx.needs_input_grad[1]:
            dw = (dy2.t().to(weight.dtype) @ x.reshape(-1, x.size(-1)).to(weight.dtype))  # [N, K]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(dy.dtype)
        return dx, dw, db


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with FP8 GEMMs where the widths allow, else ``F.linear`` itself."""
    if not fp8_shapes_ok(weight.size(1), weight.size(0)) or x.numel() == 0:
        return F.linear(x, weight, bias)
    return _FP8Linear.apply(x, weight, bias)
