"""Routed SwiGLU experts with low-rank adapters: the maths on grouped rows.

For the rows routed to expert e (grouped as ``megamoe.layers.ops.grouped_gemm`` describes)::

    gate|up = x W1_e^T + s * (drop(x) A1_e^T) B1_e^T
    act     = glu(gate, up)            (the role's gated unit, megamoe.layers.mlp.dense; times the routing prob)
    out     = act W2_e^T + s * (drop(act) A2_e^T) B2_e^T

Per-expert adapters are stacked like the weights, A1 [E, r, h], B1 [E, 2f, r], A2 [E, r, f],
B2 [E, h, r]; shared adapters are the same without E (one pair for every expert). Each rank
holds its experts' slices (and under ETP its f-slice of B1's rows and A2's columns), so the
down term is a partial sum over ETP exactly like the base output. The low-rank terms are
computed on the rows, never as a merged weight: memory is that of the rows, and the frozen
weights get no gradient. ``merged_weights`` is the definition (merge and the tests use it).

Two implementations, picked by the kernel the base experts role runs (the backend's choice):
``_LoopLoRAExperts``, the per-expert loop of the base ``loop`` kernel with the low-rank products
added to each expert's GEMMs and a hand-written backward, and plain autograd over whole-batch
products (``lora_swiglu_experts_autograd``: per-expert GEMMs under the ``reference`` kernel,
grouped GEMMs under ``grouped_mm``, and either with adapter dropout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from megamoe.layers.ops.grouped_gemm import expert_slices, swiglu_act_, swiglu_pre_grad, swiglu_recompute
from megamoe.layers.mlp.dense import SWIGLU, GLU, glu_act


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

    def select(self, experts: Sequence[int] | None) -> "ExpertLoRA":
        """The factors of some local experts (per-expert factors gathered, differentiably; a
        shared pair as it is): the adapters of one kernel call over those experts."""
        if experts is None or self.a1.dim() == 2:
            return self
        at = torch.as_tensor(list(experts), device=self.a1.device)
        a1, b1, a2, b2 = (t.index_select(0, at) for t in (self.a1, self.b1, self.a2, self.b2))
        return ExpertLoRA(a1, b1, a2, b2, self.scale, self.dropout, self.training)

    def low_rank(self, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor, counts, grouped: bool = False):
        """s * B (A drop(rows)): [S, in] -> [S, out]."""
        if self.dropout > 0:
            rows = F.dropout(rows, self.dropout, self.training)
        return expert_linear(expert_linear(rows, a, counts, grouped), b, counts, grouped) * self.scale


def _grouped_mm_ok(rows: torch.Tensor, w: torch.Tensor) -> bool:
    # torch's grouped GEMM wants every row stride a multiple of 16 bytes
    size = rows.element_size()
    return rows.size(-1) * size % 16 == 0 and w.size(1) * size % 16 == 0


def expert_linear(rows: torch.Tensor, w: torch.Tensor, counts: Sequence[int], grouped: bool = False) -> torch.Tensor:
    """rows [S, in] grouped by expert (``counts`` rows each), w [E, out, in] or [out, in] (the
    same for every expert) -> [S, out]; ``grouped``: one grouped GEMM where the strides allow."""
    if w.dim() == 2:
        return F.linear(rows, w)
    if grouped and _grouped_mm_ok(rows, w):
        op = getattr(F, "grouped_mm", None) or torch._grouped_mm
        offs = torch.tensor(list(counts), device=rows.device).cumsum(0).to(torch.int32)
        return op(rows, w.transpose(1, 2), offs=offs)
    return torch.cat([F.linear(chunk, w[e]) for e, chunk in enumerate(rows.split(list(counts)))])


def lora_swiglu_experts(kernel: str, x, idx, counts: Sequence[int], probs, w1, w2, lora: ExpertLoRA,
                        out_rows: int, glu: GLU = SWIGLU) -> torch.Tensor:
    """The expert kernel contract of ``megamoe.layers.ops.grouped_gemm`` with adapters added, in the
    form of the base role's ``kernel`` (``reference``, ``loop`` or ``grouped_mm``): the loop
    kernel's hand-written backward for ``loop`` (plain autograd with adapter dropout), whole-batch
    products under autograd otherwise (grouped GEMMs for ``grouped_mm``, per-expert ones else).

    x [N, h], idx [S], counts [E] ints, probs [S] | None, w1 [E, 2f, h], w2 [E, h, f] -> [out_rows, h].
    """
    if kernel != "loop" or (lora.dropout > 0 and lora.training):
        return lora_swiglu_experts_autograd(x, idx, counts, probs, w1, w2, lora, out_rows, glu,
                                            grouped=kernel == "grouped_mm")
    if probs is not None:
        probs = probs.to(x.dtype)
    return _LoopLoRAExperts.apply(x, idx, probs, w1, w2, lora.a1, lora.b1, lora.a2, lora.b2, list(counts), out_rows,
                                  glu, lora.scale)


def lora_swiglu_experts_autograd(x, idx, counts: Sequence[int], probs, w1, w2, lora: ExpertLoRA, out_rows: int,
                                 glu: GLU = SWIGLU, grouped: bool = False) -> torch.Tensor:
    """The same maths as whole-batch products under autograd (the reference, dropout, grouped GEMMs)."""
    rows = x.index_select(0, idx)
    gate_up = expert_linear(rows, w1, counts, grouped) + lora.low_rank(rows, lora.a1, lora.b1, counts, grouped)
    act = glu_act(gate_up, glu)
    if probs is not None:  # exact before the down projection: both of its terms are linear
        act = act * probs[:, None].to(act.dtype)
    y = expert_linear(act, w2, counts, grouped) + lora.low_rank(act, lora.a2, lora.b2, counts, grouped)
    return x.new_zeros(out_rows, x.size(-1)).index_add(0, idx, y.to(x.dtype))


def merged_weights(w1: torch.Tensor, w2: torch.Tensor, lora: ExpertLoRA) -> tuple[torch.Tensor, torch.Tensor]:
    """(W1 + s B1 A1, W2 + s B2 A2) per expert, in fp32: [E, 2f, h], [E, h, f]."""
    d1 = torch.matmul(lora.b1.float(), lora.a1.float()) * lora.scale  # [E|1, 2f, h]
    d2 = torch.matmul(lora.b2.float(), lora.a2.float()) * lora.scale
    return w1.float() + d1, w2.float() + d2


class _LoopLoRAExperts(torch.autograd.Function):
    """Per expert e on its rows xr [n, h] (A, B the expert's factors or the shared pair)::

        pre = xr W1^T + s (xr A1^T) B1^T          act = glu(gate, up) (* prob)
        y   = act W2^T + s (act A2^T) B2^T        out[rows] += y

    Saves the gate|up pre-activations and the two rank-r products ``xr A1^T`` [S, r] and
    ``act A2^T`` [S, r]; the frozen weights get a gradient only if they require one."""

    @staticmethod
    def forward(ctx, x, idx, probs, w1, w2, a1, b1, a2, b2, counts, out_rows, glu, scale):
        per_expert = a1.dim() == 3
        fac = (lambda t, e: t[e]) if per_expert else (lambda t, e: t)  # noqa: E731
        out = x.new_zeros(out_rows, x.size(-1))
        pre = x.new_empty(idx.numel(), w1.size(1))
        xa = x.new_empty(idx.numel(), a1.size(-2))
        aa = x.new_empty(idx.numel(), a2.size(-2))
        for e, sl in expert_slices(counts):
            rows = idx[sl]
            xr = x.index_select(0, rows)
            torch.mm(xr, fac(a1, e).t(), out=xa[sl])
            gu = torch.mm(xr, w1[e].t(), out=pre[sl]).addmm_(xa[sl], fac(b1, e).t(), alpha=scale)
            act = swiglu_act_(gu, glu)
            if probs is not None:
                act.mul_(probs[sl, None])
            torch.mm(act, fac(a2, e).t(), out=aa[sl])
            y = torch.mm(act, w2[e].t()).addmm_(aa[sl], fac(b2, e).t(), alpha=scale)
            out.index_add_(0, rows, y)
        ctx.counts, ctx.glu, ctx.scale = counts, glu, scale
        ctx.save_for_backward(x, idx, probs, w1, w2, a1, b1, a2, b2, pre, xa, aa)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, idx, probs, w1, w2, a1, b1, a2, b2, pre, xa, aa = ctx.saved_tensors
        need = ctx.needs_input_grad
        s, per_expert = ctx.scale, a1.dim() == 3
        fac = (lambda t, e: t[e]) if per_expert else (lambda t, e: t)  # noqa: E731
        dout = dout.contiguous()
        dx = torch.zeros_like(x)
        dprobs = None if probs is None else torch.empty_like(probs)
        dw1 = torch.zeros_like(w1) if need[3] else None
        dw2 = torch.zeros_like(w2) if need[4] else None
        da1, db1, da2, db2 = (torch.zeros_like(t) for t in (a1, b1, a2, b2))
        for e, sl in expert_slices(ctx.counts):
            rows = idx[sl]
            gate, up, g, act = swiglu_recompute(pre[sl], ctx.glu)
            dy = dout.index_select(0, rows)
            # down: y = act_p W2^T + s (act_p A2^T) B2^T, act_p = act * prob
            dyb = torch.mm(dy, fac(b2, e))                                      # [n, r]
            d_act = torch.mm(dy, w2[e]).addmm_(dyb, fac(a2, e), alpha=s)        # d act_p
            if probs is not None:
                torch.linalg.vecdot(d_act, act, out=dprobs[sl])
                act.mul_(probs[sl, None])
                d_act.mul_(probs[sl, None])
            fac(db2, e).addmm_(dy.t(), aa[sl], alpha=s)
            fac(da2, e).addmm_(dyb.t(), act, alpha=s)
            if dw2 is not None:
                torch.mm(dy.t(), act, out=dw2[e])
            d_pre = swiglu_pre_grad(d_act, gate, up, g, ctx.glu)
            # gate|up: pre = xr W1^T + s (xr A1^T) B1^T
            xr = x.index_select(0, rows)
            dpb = torch.mm(d_pre, fac(b1, e))                                   # [n, r]
            fac(db1, e).addmm_(d_pre.t(), xa[sl], alpha=s)
            fac(da1, e).addmm_(dpb.t(), xr, alpha=s)
            if dw1 is not None:
                torch.mm(d_pre.t(), xr, out=dw1[e])
            dx.index_add_(0, rows, torch.mm(d_pre, w1[e]).addmm_(dpb, fac(a1, e), alpha=s))
        return dx, None, dprobs, dw1, dw2, da1, db1, da2, db2, None, None, None, None
