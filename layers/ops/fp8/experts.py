"""FP8 grouped GEMMs for routed experts (``train.fp8=torch``), the same recipe as ``layers.fp8``.

    y[rows of group g] = a[rows of group g] @ W[g]^T

    a    [S, K]     rows grouped by expert (group g owns rows offs[g-1]..offs[g]-1)
    W    [G, N, K]  one nn.Linear-layout weight per expert
    offs [G]        int32 end offsets of the groups, on a's device
    y    [S, N]

Forward and input gradient run in e4m3 with one scale per row of the token operand and one
per output (forward) or input (dgrad) feature of each expert's weight; the weight gradient
stays in the input dtype. On CUDA the GEMMs are ``torch._scaled_grouped_mm`` (one launch for
every expert) and the weight gradient ``torch._grouped_mm``; the scaled grouped GEMM wants
every group to start on a 16-row boundary, so ``swiglu_experts_fp8`` lays the rows out in
16-row-aligned groups first (computed on the device: no host sync). Elsewhere (the CPU
tests) each group runs ``torch._scaled_mm`` with the same quantisation.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from megamoe.layers.ops.fp8.linear import fp8_shapes_ok, quantize
from megamoe.layers.mlp.dense import SWIGLU, GLU, glu_act

ALIGN = 16  # rows: the scaled grouped GEMM's group alignment


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same [.., R, C] values laid out column-major (what the right operand must be)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _grouped(device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")


def _loop(aq, sa, bq, sb, offs, out_dtype):
    """Per-group ``_scaled_mm``: aq [S, K] (sa [S, 1]) @ bq [G, K, N] (sb [G, 1, N]) -> [S, N]."""
    out = aq.new_zeros(aq.size(0), bq.size(-1), dtype=out_dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = torch._scaled_mm(aq[start:end], bq[g], scale_a=sa[start:end], scale_b=sb[g],
                                              out_dtype=torch.bfloat16).to(out_dtype)
        start = end
    return out


def _scaled_grouped(a, b, offs, a_dim, b_dim, out_dtype):
    """a [S, K] @ b [G, K, N] with a quantised along ``a_dim`` and b along ``b_dim`` (the
    contraction dims) -> [S, N]."""
    aq, sa = quantize(a, a_dim)                       # [S, K], [S, 1]
    bq, sb = quantize(b, b_dim)                       # [G, K, N], [G, 1, N]
    bq = _col_major(bq)
    if _grouped(a.device):
        y = torch._scaled_grouped_mm(aq, bq, sa.squeeze(-1), sb.squeeze(1), offs=offs, out_dtype=torch.bfloat16)
        return y.to(out_dtype)
    return _loop(aq, sa, bq, sb, offs, out_dtype)


def _wgrad(dy, a, offs, n_groups, dtype):
    """dW[g] = dy_g^T a_g in high precision -> [G, N, K]."""
    if _grouped(a.device):
        return torch._grouped_mm(dy.t().to(dtype), a.to(dtype), offs=offs)
    dw = a.new_zeros(n_groups, dy.size(1), a.size(1), dtype=dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            dw[g] = dy[start:end].t().to(dtype) @ a[start:end].to(dtype)
        start = end
    return dw


class _FP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, offs):
        ctx.save_for_backward(a, w, offs)
        return _scaled_grouped(a, w.transpose(-2, -1), offs, 1, 1, a.dtype)    # a @ W^T

    @staticmethod
    def backward(ctx, dy):
        a, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        da = _scaled_grouped(dy, w, offs, 1, 1, a.dtype)                     # dy @ W: W [G, N, K]
        dw = _wgrad(dy, a, offs, w.size(0), w.dtype)
        return da, dw, None


def fp8_grouped_linear(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _FP8GroupedLinear.apply(a, w, offs)


def aligned_layout(counts: torch.Tensor, rows: int, align: int = ALIGN):
    """Rows grouped by expert -> the same groups each starting on an ``align`` boundary.

    counts [G] int (device) -> (dest [rows]: where each row goes, offs [G] int32: padded end
    offsets, padded_rows: a static bound, rows + G * (align - 1) rounded up). All on the
    device, without reading counts on the host."""
    counts = counts.to(torch.int64)
    padded = (counts + align - 1) // align * align
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=rows)
    dest = torch.arange(rows, device=counts.device) - start[group] + pstart[group]
    bound = (rows + counts.numel() * (align - 1) + align - 1) // align * align
    return dest, torch.cumsum(padded, 0).to(torch.int32), bound


def swiglu_experts_fp8(x, idx, counts: Sequence[int] | torch.Tensor, probs, w1, w2, out_rows: int,
                       glu: GLU = SWIGLU) -> torch.Tensor:
    """The SwiGLU expert kernel (signature and result as ``layers.grouped_gemm``'s reference)
    with FP8 grouped GEMMs. Widths that the scaled GEMM rejects (not multiples of 16) return
    None so the caller runs its high-precision kernel."""
    h, f = x.size(-1), w2.size(-1)
    if not (fp8_shapes_ok(h, 2 * f) and fp8_shapes_ok(f, h)):
        return None
    counts = torch.as_tensor(counts, device=x.device)
    rows = x.index_select(0, idx)                                           # [S, h]
    p = None if probs is None else probs[:, None].to(x.dtype)               # [S, 1]
    if _grouped(x.device):                                                  # 16-row-aligned groups
        dest, offs, bound = aligned_layout(counts, rows.size(0))
        rows = rows.new_zeros(bound, h).index_copy(0, dest, rows)
        p = None if p is None else p.new_zeros(bound, 1).index_copy(0, dest, p)
    else:
        dest, offs = None, torch.cumsum(counts, 0).to(torch.int32)
    act = glu_act(fp8_grouped_linear(rows, w1, offs), glu)
    if p is not None:
        act = act * p
    y = fp8_grouped_linear(act, w2, offs)                                   # [S or bound, h]
    if dest is not None:
        y = y.index_select(0, dest)
    return x.new_zeros(out_rows, h).index_add(0, idx, y)
