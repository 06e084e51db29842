"""Grouped SwiGLU expert kernels: one weight pair per expert, rows grouped by expert.

Every kernel computes the same thing (``reference`` is the readable definition)::

    out = kernel(x, idx, counts, probs, w1, w2, out_rows, glu=SWIGLU)

    x      [N, h]      input rows
    idx    [S]         grouped row j reads x[idx[j]] and is added to out[idx[j]]
    counts [E]         python ints: rows 0..counts[0]-1 go to expert 0, the next counts[1] to 1, ...
    probs  [S] | None  weight of row j, applied to its intermediate activation
    w1     [E, 2f, h]  gate | up (nn.Linear layout: out x in)
    w2     [E, h, f]   down
    out    [out_rows, h] = sum over rows j of  probs[j] * down_e(act(gate_e x, up_e x))
    glu    GLU           the gated unit ``act`` (``megamoe.layers.mlp.dense``): silu(gate) * up, clamped
                         (GLM-5-Next) or SwiGLU-OAI (MiniMax-M3)

Applying ``probs`` to the intermediate instead of the output is exact (down is linear) and
keeps it valid when f is split over expert-tensor-parallel ranks (the output is then a
partial sum). ``idx`` lets the single-process path read tokens in place and accumulate
straight into the token output, without materialising a permuted copy.

Kernels:
- ``reference``: per-expert loop of plain autograd ops.
- ``grouped_mm``: torch's grouped GEMM (``F.grouped_mm`` / ``torch._grouped_mm``) over the
  whole permuted batch; availability and dtype support are probed at run time, and widths
  whose rows are not multiples of 16 bytes (which it rejects) run the loop instead.
- ``loop``: per-expert ``mm`` into grouped buffers with a hand-written backward, over blocks
  of consecutive experts (``BLOCK_ROWS`` rows or more): per block one gather, one SwiGLU pass
  (fused with ``fuse``, see ``megamoe.layers.ops.fusion``) and one scatter-add between the GEMM
  loops. On CPU this beat torch's grouped GEMM, a per-expert pipeline of small elementwise
  ops and whole-batch passes (see docs/performance.md).
``auto`` is not a kernel: the backend that builds the experts role resolves it (its
``auto_expert_kernel``).
"""
from __future__ import annotations

import itertools

from typing import Sequence

import torch
import torch.nn.functional as F

from megamoe.core.errors import ConfigError
from megamoe.layers.ops.fusion import call, fused
from megamoe.layers.mlp.dense import SWIGLU, GLU, clamp_gate_up, glu_act, glu_gate, glu_gate_grad, shifted

KERNELS = ("reference", "grouped_mm", "loop")


def swiglu_experts_reference(x, idx, counts: Sequence[int], probs, w1, w2, out_rows: int,
                             glu: GLU = SWIGLU, fuse: bool = False) -> torch.Tensor:
    """The definition: a loop over experts with plain autograd ops."""
    out = x.new_zeros(out_rows, x.size(-1))
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = idx[start:start + n]
        act = glu_act(F.linear(x[rows], w1[e]), glu)
        if probs is not None:
            act = act * probs[start:start + n, None].to(act.dtype)
        out = out.index_add(0, rows, F.linear(act, w2[e]))
        start += n
    return out


# ---- torch grouped GEMM ------------------------------------------------------------------

def _grouped_mm_op():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


_PROBED: dict[tuple, str | None] = {}


def grouped_mm_support(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if torch's grouped GEMM runs forward+backward for (device, dtype), else why not."""
    key = (device.type, dtype)
    if key not in _PROBED:
        op = _grouped_mm_op()
        if op is None:
            _PROBED[key] = f"torch {torch.__version__} has no grouped_mm"
        else:
            try:  # with autograd on: a first call from a no-grad forward must not cache a failure
                a = torch.randn(5, 16, device=device, dtype=dtype, requires_grad=True)
                b = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                with torch.enable_grad():
                    y = op(a, b, offs=torch.tensor([2, 5], device=device, dtype=torch.int32))
                    y.backward(torch.ones_like(y))
                _PROBED[key] = None
            except (RuntimeError, NotImplementedError, TypeError) as e:
                _PROBED[key] = f"grouped_mm failed on {device.type}/{dtype}: {str(e).splitlines()[0]}"
    return _PROBED[key]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the CPU grouped_mm
    backward rejects expanded (stride-0) gradients such as those of ``y.sum()``."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _rows_aligned(t: torch.Tensor, *widths: int) -> bool:
    """torch's grouped GEMM wants every row stride to be a multiple of 16 bytes."""
    return all(w * t.element_size() % 16 == 0 for w in widths)


def swiglu_experts_grouped_mm(x, idx, counts: Sequence[int], probs, w1, w2, out_rows: int,
                              glu: GLU = SWIGLU, fuse: bool = False) -> torch.Tensor:
    if not _rows_aligned(x, x.size(-1), w2.size(-1)):  # h or f not a multiple of 16 bytes
        return swiglu_experts_loop(x, idx, counts, probs, w1, w2, out_rows, glu, fuse)
    op = _grouped_mm_op()
    offs = torch.tensor(list(itertools.accumulate(counts)), device=x.device, dtype=torch.int32)
    rows = x.index_select(0, idx)
    act = glu_act(op(rows, w1.transpose(1, 2), offs=offs), glu)
    if probs is not None:
        act = act * probs[:, None].to(act.dtype)
    y = op(act, w2.transpose(1, 2), offs=offs)
    if torch.is_grad_enabled():
        y = _ContiguousGrad.apply(y)
    return x.new_zeros(out_rows, x.size(-1)).index_add(0, idx, y)


# ---- per-expert loop with a fused backward -----------------------------------------------

def expert_slices(counts: Sequence[int]):
    """(expert, slice of its grouped rows) for every expert that has rows."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
        start += n


def swiglu_recompute(gate_up: torch.Tensor, glu: GLU = SWIGLU):
    """(gate, up, g, g * (up + shift)) with g = gate * sigmoid(alpha gate) from saved (clamped)
    pre-activations [n, 2f]."""
    gate, up = gate_up.chunk(2, dim=-1)
    g = glu_gate(gate, glu)
    return gate, up, g, g * shifted(up, glu)


def swiglu_act_(gate_up: torch.Tensor, glu: GLU) -> torch.Tensor:
    """The gated unit of pre-activations [n, 2f] (clamped in place with a limit) -> [n, f]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if glu.limit is not None:
        gate.clamp_(max=glu.limit)
        up.clamp_(-glu.limit, glu.limit)
    return glu_gate(gate, glu).mul_(shifted(up, glu))


def swiglu_pre_grad(d_act: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor,
                    glu: GLU) -> torch.Tensor:
    """d(gate|up) [n, 2f] from d act [n, f] (overwritten), with g = glu_gate(gate); clamped
    entries (saved pre-activations at the bound) pass no gradient."""
    d_pre = torch.empty(d_act.size(0), 2 * d_act.size(1), dtype=d_act.dtype, device=d_act.device)
    d_gate, d_up = d_pre.chunk(2, dim=-1)
    torch.mul(d_act, g, out=d_up)
    d_act.mul_(shifted(up, glu))
    if glu.alpha == 1.0:
        torch.ops.aten.silu_backward.grad_input(d_act, gate, grad_input=d_gate)
    else:
        torch.mul(d_act, glu_gate_grad(gate, glu), out=d_gate)
    if glu.limit is not None:
        d_gate.mul_(gate < glu.limit)
        d_up.mul_(up.abs() < glu.limit)
    return d_pre


@fused
def swiglu_weighted(pre: torch.Tensor, p: torch.Tensor | None, glu: GLU) -> torch.Tensor:
    """Fused: p * act(gate, up) of pre-activations [n, 2f] (clamped with a limit; ``pre`` is
    left as it is) and row weights p [n, 1] | None -> [n, f]."""
    act = glu_act(pre, glu)
    return act if p is None else act * p


@fused
def swiglu_weighted_backward(d_act: torch.Tensor, pre: torch.Tensor, p: torch.Tensor | None, glu: GLU):
    """Fused backward of ``swiglu_weighted`` from d(output) [n, f] -> (d(gate|up) [n, 2f],
    d p [n] | None, the output again [n, f] for the down weight's gradient). Clamped entries
    (at or beyond the bound) pass no gradient."""
    gate0, up0 = pre.chunk(2, dim=-1)
    gate, up = clamp_gate_up(gate0, up0, glu.limit)
    sig = torch.sigmoid(glu.alpha * gate)
    g = gate * sig
    up = shifted(up, glu)
    act = g * up
    dp = None
    if p is not None:
        dp = (d_act * act).sum(-1)
        d_act, act = d_act * p, act * p
    d_up = d_act * g
    d_gate = d_act * up * sig * (1 + glu.alpha * gate * (1 - sig))
    if glu.limit is not None:
        d_gate, d_up = d_gate * (gate0 < glu.limit), d_up * (up0.abs() < glu.limit)
    return torch.cat([d_gate, d_up], dim=-1), dp, act


def swiglu_forward(pre: torch.Tensor, p: torch.Tensor | None, glu: GLU, fuse: bool) -> torch.Tensor:
    """p * act of pre-activations [n, 2f] -> [n, f]: fused, or eagerly in place (a limit then
    clamps ``pre`` itself, which is what ``swiglu_backward`` expects to find saved)."""
    if fuse:
        return swiglu_weighted(pre, p, glu)
    act = swiglu_act_(pre, glu)
    return act if p is None else act.mul_(p)


def swiglu_backward(d_act: torch.Tensor, pre: torch.Tensor, p: torch.Tensor | None, glu: GLU, fuse: bool):
    """Backward of ``swiglu_forward`` (the same ``fuse``) from d(output) [n, f] (overwritten
    eagerly) -> (d(gate|up) [n, 2f], d p [n] | None, the output [n, f]). The unit is
    recomputed from the saved pre-activations."""
    if fuse:
        return swiglu_weighted_backward(d_act, pre, p, glu)
    gate, up, g, act = swiglu_recompute(pre, glu)
    dp = None
    if p is not None:
        dp = torch.linalg.vecdot(d_act, act)
        act.mul_(p)
        d_act.mul_(p)
    return swiglu_pre_grad(d_act, gate, up, g, glu), dp, act


def expert_blocks(counts: Sequence[int], block_rows: int):
    """Consecutive experts grouped until a block holds at least ``block_rows`` rows:
    (slice of the block's grouped rows, [(expert, slice within the block)]) per block."""
    block, start = [], 0
    for e, sl in expert_slices(counts):
        block.append((e, slice(sl.start - start, sl.stop - start)))
        if sl.stop - start >= block_rows:
            yield slice(start, sl.stop), block
            block, start = [], sl.stop
    if block:
        yield slice(start, start + block[-1][1].stop), block


def _expert_mms(a: torch.Tensor, w_t: Sequence[torch.Tensor], experts, out: torch.Tensor) -> None:
    """out[sl] = a[sl] @ w_t[e] for the (expert, slice) pairs of one block (consecutive slices
    covering its rows). The row slices come from one split, the weights are transposed views
    made once per call (one unbind): at decode a block holds a few rows per expert, and a
    slice, select and transpose per GEMM were 40% of a step's dispatcher calls
    (docs/performance.md, "Batched decoding")."""
    sizes = [sl.stop - sl.start for _, sl in experts]
    for (e, _), a_e, out_e in zip(experts, a.split(sizes), out.split(sizes)):
        torch.mm(a_e, w_t[e], out=out_e)


# rows per block of the loop kernel: enough that the per-op cost of the SwiGLU passes is paid
# for many experts at once, few enough that a block's buffers stay cached and come back from
# the heap instead of being mapped afresh (whole-batch buffers at 64 experts x 4096 tokens
# x top-8 made the layer 1.3x slower; see docs/performance.md)
BLOCK_ROWS = 4096
# (token, expert) pairs up to which a forward without autograd (a decode step) and without a
# plain SwiGLU runs torch's grouped GEMM instead: the same products (bitwise, on CPU fp32) in two
# ops instead of two per expert; at 16 pairs over 8 layers of 16 experts ~8-10% faster than the loop
# (1 and 2 threads, docs/performance.md); larger batches were not measured, so they keep the loop
DECODE_ROWS = 64


class _LoopExperts(torch.autograd.Function):
    """Blocks of consecutive experts (``expert_blocks``): per block, per-expert GEMMs and one
    SwiGLU pass over the block's rows (fused with ``fuse``), so the
    rows stay in cache while the number of small ops stays low. Saves only the gate|up
    pre-activations [S, 2f]; recomputes the SwiGLU and re-gathers the input rows in backward.
    Eagerly with a ``glu.limit`` the saved pre-activations are the clamped ones: a value at the
    bound was clamped (or lay exactly on it, a measure-zero case) and gets no gradient; the
    fused pass clamps on the fly and masks the same entries."""

    @staticmethod
    def run(x, idx, probs, w1, w2, counts, out_rows, glu, fuse):
        """The forward's maths -> (out [out_rows, h], gate|up pre-activations [S, 2f]); called
        directly where nothing needs a gradient (decoding: no autograd node per layer)."""
        out = x.new_zeros(out_rows, x.size(-1))
        pre = x.new_empty(idx.numel(), w1.size(1))    # gate|up pre-activations [S, 2f]
        w1t, w2t = w1.transpose(1, 2).unbind(0), w2.transpose(1, 2).unbind(0)  # E x [h, 2f], E x [f, h] views
        for blk, experts in expert_blocks(counts, BLOCK_ROWS):
            rows, pre_b = x.index_select(0, idx[blk]), pre[blk]
            _expert_mms(rows, w1t, experts, pre_b)
            act = swiglu_forward(pre_b, None if probs is None else probs[blk, None], glu, fuse)
            y = torch.empty_like(rows)
            _expert_mms(act, w2t, experts, y)
            out.index_add_(0, idx[blk], y)
        return out, pre

    @staticmethod
    def forward(ctx, x, idx, probs, w1, w2, counts, out_rows, glu, fuse):
        ctx.fuse = fuse
        out, pre = _LoopExperts.run(x, idx, probs, w1, w2, counts, out_rows, glu, fuse)
        ctx.counts, ctx.glu = counts, glu
        ctx.save_for_backward(x, idx, probs, w1, w2, pre)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, idx, probs, w1, w2, pre = ctx.saved_tensors
        dout = dout.contiguous()
        dx = torch.zeros_like(x)
        # every expert with rows writes its whole weight gradient; only empty ones need zeros.
        # Frozen weights get none (LoRA, tiered experts: w1/w2 may be views of a whole store)
        need_w = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dw1, dw2 = (torch.empty_like(w1), torch.empty_like(w2)) if need_w else (None, None)
        dprobs = None if probs is None else torch.empty_like(probs)
        for e in (e for e, n in enumerate(ctx.counts) if n == 0 and need_w):
            dw1[e].zero_()
            dw2[e].zero_()
        for blk, experts in expert_blocks(ctx.counts, BLOCK_ROWS):
            dy = dout.index_select(0, idx[blk])
            d_act = x.new_empty(dy.size(0), w2.size(2))  # gradient wrt the (weighted) activation
            for e, sl in experts:
                torch.mm(dy[sl], w2[e], out=d_act[sl])
            d_pre, dp, act = swiglu_backward(d_act, pre[blk], None if probs is None else probs[blk, None],
                                             ctx.glu, ctx.fuse)
            if dp is not None:
                dprobs[blk] = dp
            rows = x.index_select(0, idx[blk])
            if need_w:
                for e, sl in experts:
                    torch.mm(dy[sl].t(), act[sl], out=dw2[e])
                    torch.mm(d_pre[sl].t(), rows[sl], out=dw1[e])
            d_rows = torch.empty_like(rows)
            for e, sl in experts:
                torch.mm(d_pre[sl], w1[e], out=d_rows[sl])
            dx.index_add_(0, idx[blk], d_rows)
        return dx, None, dprobs, dw1, dw2, None, None, None, None


class _SharedSwiGLUAdd(torch.autograd.Function):
    """``y + p * down(silu(gate x) * up x)`` with ``p = sigmoid(x g^T)`` (or 1): a shared expert
    added to the routed output. Like the loop kernel it applies ``p`` to the intermediate and
    saves only the gate|up pre-activations; the output GEMM accumulates into ``y`` (no
    separate multiply and add over [T, h]).

    y, x [T, h]; w1 [2f, h]; w2 [h, f]; gate_w [1, h] | None."""

    @staticmethod
    def run(y, x, w1, w2, gate_w, glu, fuse):
        """The forward's maths -> (output, pre-activations, gate p | None)."""
        pre = torch.mm(x, w1.t())
        p = None if gate_w is None else torch.sigmoid(torch.mm(x, gate_w.t()))  # [T, 1]
        act = swiglu_forward(pre, p, glu, fuse)
        return torch.addmm(y, act, w2.t()), pre, p

    @staticmethod
    def forward(ctx, y, x, w1, w2, gate_w, glu, fuse):
        ctx.fuse, ctx.glu = fuse, glu
        out, pre, p = _SharedSwiGLUAdd.run(y, x, w1, w2, gate_w, glu, fuse)
        ctx.save_for_backward(x, w1, w2, gate_w, pre, p)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, gate_w, pre, p = ctx.saved_tensors
        need = ctx.needs_input_grad
        dout = dout.contiguous()
        d_pre, dp, act = swiglu_backward(torch.mm(dout, w2), pre, p, ctx.glu, ctx.fuse)
        dw2 = torch.mm(dout.t(), act) if need[3] else None
        dw1 = torch.mm(d_pre.t(), x) if need[2] else None
        dx = torch.mm(d_pre, w1)
        dgate_w = None
        if p is not None:
            dlogit = dp.unsqueeze(1).mul_(p * (1 - p))  # d(x g^T)
            dgate_w = torch.mm(dlogit.t(), x) if need[4] else None
            dx.addmm_(dlogit, gate_w)
        return dout, dx, dw1, dw2, dgate_w, None, None


def shared_swiglu_add(y, x, w1, w2, gate_w=None, glu: GLU = SWIGLU, fuse: bool = False) -> torch.Tensor:
    """y + [sigmoid(x gate_w^T)] * SwiGLU(x) for y, x [T, h] (see ``_SharedSwiGLUAdd``)."""
    return call(_SharedSwiGLUAdd, y, x, w1, w2, gate_w, glu, fuse)


def swiglu_experts_loop(x, idx, counts: Sequence[int], probs, w1, w2, out_rows: int,
                        glu: GLU = SWIGLU, fuse: bool = False) -> torch.Tensor:
    if probs is not None:
        probs = probs.to(x.dtype)
    if (not torch.is_grad_enabled() and glu == SWIGLU and idx.numel() <= DECODE_ROWS
            and _rows_aligned(x, x.size(-1), w2.size(-1)) and grouped_mm_support(x.device, x.dtype) is None):
        return swiglu_experts_grouped_mm(x, idx, counts, probs, w1, w2, out_rows, glu)
    return call(_LoopExperts, x, idx, probs, w1, w2, list(counts), out_rows, glu, fuse)


_FUNCS = {"reference": swiglu_experts_reference, "grouped_mm": swiglu_experts_grouped_mm,
          "loop": swiglu_experts_loop}


def check_kernel(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``name`` if that kernel runs here (``auto`` is the backend's to resolve first)."""
    if name == "grouped_mm":
        why = grouped_mm_support(device, dtype)
        if why is not None:
            raise ConfigError(f"model.moe.expert_kernel='grouped_mm' is unavailable here ({why}); "
                              f"allowed: auto, loop, reference")
    elif name not in _FUNCS:
        raise ConfigError(f"model.moe.expert_kernel={name!r} is invalid: allowed: auto, {', '.join(KERNELS)}")
    return name


def swiglu_experts(kernel: str, x, idx, counts, probs, w1, w2, out_rows: int, glu: GLU = SWIGLU,
                   fuse: bool = False) -> torch.Tensor:
    """Dispatch to a kernel by name (see the module docstring for the contract); ``fuse``: the
    loop kernel's SwiGLU passes run compiled (``megamoe.layers.ops.fusion``)."""
    if len(counts) != w1.size(0):
        raise ValueError(f"counts has {len(counts)} entries for {w1.size(0)} experts")
    if sum(counts) != idx.numel():
        raise ValueError(f"counts sum to {sum(counts)} but {idx.numel()} rows were given")
    return _FUNCS[check_kernel(kernel, x.device, x.dtype)](x, idx, counts, probs, w1, w2, out_rows, glu, fuse)


