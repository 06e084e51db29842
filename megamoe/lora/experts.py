"""Routed SwiGLU experts with low-rank adapters: the maths on grouped rows.

For the rows routed to expert e (grouped as ``megamoe.layers.grouped_gemm`` describes)::

    gate|up = x W1_e^T + s * (drop(x) A1_e^T) B1_e^T
    act     = silu(gate) * up          (clamped first with a swiglu limit; times the routing prob)
    out     = act W2_e^T + s * (drop(act) A2_e^T) B2_e^T

Per-expert adapters are stacked like the weights, A1 [E, r, h], B1 [E, 2f, r], A2 [E, r, f],
B2 [E, h, r]; shared adapters are the same without E (one pair for every expert). Each rank
holds its experts' slices (and under ETP its f-slice of B1's rows and A2's columns), so the
down term is a partial sum over ETP exactly like the base output. The low-rank terms are
computed on the rows, never as a merged weight: memory is that of the rows, and the frozen
weights get no gradient. ``merged_weights`` is the definition (merge and the tests use it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from megamoe.layers.grouped_gemm import grouped_mm_support
from megamoe.layers.mlp import clamp_gate_up


@dataclass
class ExpertLoRA:
    """This rank's adapter factors (3-D per expert or 2-D shared) and how they apply."""

    a1: torch.Tensor  # [E, r, h] | [r, h]
    b1: torch.Tensor  # [E, 2f, r] | [2f, r]   (local f-slice of gate and of up)
    a2: torch.Tensor  # [E, r, f] | [r, f]     (local f-slice)
    b2: torch.Tensor  # [E, h, r] | [h, r]
    scale: float
    dropout: float = 0.0
    training: bool = False

    def low_rank(self, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor, counts) -> torch.Tensor:
        """s * B (A drop(rows)): [S, in] -> [S, out]."""
        if self.dropout > 0:
            rows = F.dropout(rows, self.dropout, self.training)
        return expert_linear(expert_linear(rows, a, counts), b, counts) * self.scale


def _grouped_mm_ok(rows: torch.Tensor, w: torch.Tensor) -> bool:
    # torch's grouped GEMM on accelerators (on CPU the per-expert loop is faster, docs/performance.md),
    # when every row stride is a multiple of 16 bytes
    size = rows.element_size()
    return (rows.device.type != "cpu" and grouped_mm_support(rows.device, rows.dtype) is None
            and rows.size(-1) * size % 16 == 0 and w.size(1) * size % 16 == 0)


def expert_linear(rows: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """rows [S, in] grouped by expert (``counts`` rows each), w [E, out, in] or [out, in] (the
    same for every expert) -> [S, out]."""
    if w.dim() == 2:
        return F.linear(rows, w)
    if _grouped_mm_ok(rows, w):
        op = getattr(F, "grouped_mm", None) or torch._grouped_mm
        offs = torch.tensor(list(counts), device=rows.device).cumsum(0).to(torch.int32)
        return op(rows, w.transpose(1, 2), offs=offs)
    return torch.cat([F.linear(chunk, w[e]) for e, chunk in enumerate(rows.split(list(counts)))])


def lora_swiglu_experts(x, idx, counts: Sequence[int], probs, w1, w2, lora: ExpertLoRA, out_rows: int,
                        limit: float | None = None) -> torch.Tensor:
    """The expert kernel contract of ``megamoe.layers.grouped_gemm`` with adapters added.

    x [N, h], idx [S], counts [E] ints, probs [S] | None, w1 [E, 2f, h], w2 [E, h, f] -> [out_rows, h].
    """
    rows = x.index_select(0, idx)
    gate_up = expert_linear(rows, w1, counts) + lora.low_rank(rows, lora.a1, lora.b1, counts)
    gate, up = clamp_gate_up(*gate_up.chunk(2, dim=-1), limit)
    act = F.silu(gate) * up
    if probs is not None:  # exact before the down projection: both of its terms are linear
        act = act * probs[:, None].to(act.dtype)
    y = expert_linear(act, w2, counts) + lora.low_rank(act, lora.a2, lora.b2, counts)
    return x.new_zeros(out_rows, x.size(-1)).index_add(0, idx, y.to(x.dtype))


def merged_weights(w1: torch.Tensor, w2: torch.Tensor, lora: ExpertLoRA) -> tuple[torch.Tensor, torch.Tensor]:
    """(W1 + s B1 A1, W2 + s B2 A2) per expert, in fp32: [E, 2f, h], [E, h, f]."""
    d1 = torch.matmul(lora.b1.float(), lora.a1.float()) * lora.scale  # [E|1, 2f, h]
    d2 = torch.matmul(lora.b2.float(), lora.a2.float()) * lora.scale
    return w1.float() + d1, w2.float() + d2
