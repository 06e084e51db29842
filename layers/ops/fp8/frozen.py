"""Frozen FP8 weights: e4m3 values with float32 block scales, dequantised per GEMM.

A released FP8 checkpoint scales each 128x128 block of a weight [N, K] by one float32. megamoe
keeps those values and scales (``megamoe.model.fp8_base``) in a form any row split takes apart::

    q          [..., N, K_local]  e4m3; K_local: this rank's columns (all of K unless a group splits them)
    scale      [..., N, C]        float32: row n's scale in column block c of the FULL K (the block
                                  scales repeated over their rows, C = ceil(K / block_cols))
    col_block  [K_local]          int64: the column block (of the full K) of each local column

    W[..., n, k] = q[..., n, k] * scale[..., n, col_block[k]]

so a rank holding any rows (TP's column-parallel split, EP's experts, ETP's f-slice) holds their
scales, and one holding any columns (a row-parallel split) indexes the blocks it needs. The
scales add 4/128 bytes per weight to e4m3's 1 (0.52x of bf16).

The weights never train: the product's backward gives the input gradient through the weight
dequantised again, and no dequantised copy is kept between forward and backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, col_block: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """q [..., N, K_local] e4m3, scale [..., N, C], col_block [K_local] -> W [..., N, K_local] ``dtype``."""
    return (q.float() * scale.index_select(-1, col_block)).to(dtype)


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T (+ b) with W = dequantize_rows(q, scale, col_block); gradients for x (and b)."""

    @staticmethod
    def forward(ctx, x, q, scale, col_block, bias):
        ctx.save_for_backward(q, scale, col_block)
        ctx.has_bias = bias is not None
        return F.linear(x, dequantize_rows(q, scale, col_block, x.dtype), bias)

    @staticmethod
    def backward(ctx, dy):
        q, scale, col_block = ctx.saved_tensors
        dx = dy @ dequantize_rows(q, scale, col_block, dy.dtype) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.size(-1)).sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return dx, None, None, None, db


def frozen_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, col_block: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K_local] -> [..., N] through the frozen FP8 weight (shapes: module docstring)."""
    return _FrozenLinear.apply(x, q, scale, col_block, bias)
