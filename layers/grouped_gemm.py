"""Grouped SwiGLU expert kernels: one weight pair per expert, rows grouped by expert.

Every kernel computes the same thing (``reference`` is the readable definition)::

    out = kernel(x, idx, counts, probs, w1, w2, out_rows, limit=None)

    x      [N, h]      input rows
    idx    [S]         grouped row j reads x[idx[j]] and is added to out[idx[j]]
    counts [E]         python ints: rows 0..counts[0]-1 go to expert 0, the next counts[1] to 1, ...
    probs  [S] | None  weight of row j, applied to its intermediate activation
    w1     [E, 2f, h]  gate | up (nn.Linear layout: out x in)
    w2     [E, h, f]   down
    out    [out_rows, h] = sum over rows j of  probs[j] * down_e(silu(gate_e x) * up_e x)
    limit  float | None  GLM-5's clamp of gate (<= limit) and up ([-limit, limit]) before the SwiGLU

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
  (fused with ``fuse``, see ``megamoe.fusion``) and one scatter-add between the GEMM
  loops. On CPU this beat torch's grouped GEMM, a per-expert pipeline of small elementwise
  ops and whole-batch passes (see docs/performance.md).
``auto`` picks ``grouped_mm`` on accelerators where the probe passes, ``loop`` otherwise.
"""
from __future__ import annotations

import itertools

from typing import Sequence

import torch
import torch.nn.functional as F

from megamoe.errors import ConfigError
from megamoe.fusion import call, fused
from megamoe.layers.mlp import clamp_gate_up

KERNELS = ("reference", "grouped_mm", "loop")


def swiglu_experts_reference(x, idx, counts: Sequence[int], probs, w1, w2, out_rows: int,
                             limit: float | None = None, fuse: bool = False) -> torch.Tensor:
    """The definition: a loop over experts with plain autograd ops."""
    out = x.new_zeros(out_rows, x.size(-1))
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = idx[start:start + n]
        gate, up = clamp_gate_up(*F.linear(x[rows], w1[e]).chunk(2, dim=-1), limit)
        act = F.silu(gate) * up
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
                              limit: float | None = None, fuse: bool = False) -> torch.Tensor:
    if not _rows_aligned(x, x.size(-1), w2.size(-1)):  # h or f not a multiple of 16 bytes
        return swiglu_experts_loop(x, idx, counts, probs, w1, w2, out_rows, limit, fuse)
    op = _grouped_mm_op()
    offs = torch.tensor(list(itertools.accumulate(counts)), device=x.device, dtype=torch.int32)
    rows = x.index_select(0, idx)
    gate, up = clamp_gate_up(*op(rows, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1), limit)
    act = F.silu(gate) * up
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


def swiglu_recompute(gate_up: torch.Tensor):
    """(gate, up, silu(gate), silu(gate) * up) from saved pre-activations [n, 2f]."""
    gate, up = gate_up.chunk(2, dim=-1)
    silu = F.silu(gate)
    return gate, up, silu, silu * up


def swiglu_act_(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up of pre-activations [n, 2f] (clamped in place with a limit) -> [n, f]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate.clamp_(max=limit)
        up.clamp_(-limit, limit)
    return F.silu(gate).mul_(up)


def swiglu_pre_grad(d_act: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, silu: torch.Tensor,
                    limit: float | None) -> torch.Tensor:
    """d(gate|up) [n, 2f] from d(silu(gate) * up) [n, f] (overwritten); clamped entries (saved
    pre-activations at the bound) pass no gradient."""
    d_pre = torch.empty(d_act.size(0), 2 * d_act.size(1), dtype=d_act.dtype, device=d_act.device)
    d_gate, d_up = d_pre.chunk(2, dim=-1)
    torch.mul(d_act, silu, out=d_up)
    torch.ops.aten.silu_backward.grad_input(d_act.mul_(up), gate, grad_input=d_gate)
    if limit is not None:
        d_gate.mul_(gate < limit)
        d_up.mul_(up.abs() < limit)
    return d_pre


@fused
def swiglu_weighted(pre: torch.Tensor, p: torch.Tensor | None, limit: float | None) -> torch.Tensor:
    """Fused: p * silu(gate) * up of pre-activations [n, 2f] (clamped with a limit; ``pre`` is
    left as it is) and row weights p [n, 1] | None -> [n, f]."""
    gate, up = clamp_gate_up(*pre.chunk(2, dim=-1), limit)
    act = F.silu(gate) * up
    return act if p is None else act * p


@fused
def swiglu_weighted_backward(d_act: torch.Tensor, pre: torch.Tensor, p: torch.Tensor | None, limit: float | None):
    """Fused backward of ``swiglu_weighted`` from d(output) [n, f] -> (d(gate|up) [n, 2f],
    d p [n] | None, the output again [n, f] for the down weight's gradient). Clamped entries
    (at or beyond the bound) pass no gradient."""
    gate0, up0 = pre.chunk(2, dim=-1)
    gate, up = clamp_gate_up(gate0, up0, limit)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    act = silu * up
    dp = None
    if p is not None:
        dp = (d_act * act).sum(-1)
        d_act, act = d_act * p, act * p
    d_up = d_act * silu
    d_gate = d_act * up * sig * (1 + gate * (1 - sig))
    if limit is not None:
        d_gate, d_up = d_gate * (gate0 < limit), d_up * (up0.abs() < limit)
    return torch.cat([d_gate, d_up], dim=-1), dp, act


def swiglu_forward(pre: torch.Tensor, p: torch.Tensor | None, limit: float | None, fuse: bool) -> torch.Tensor:
    """p * SwiGLU of pre-activations [n, 2f] -> [n, f]: fused, or eagerly in place (a limit then
    clamps ``pre`` itself, which is what ``swiglu_backward`` expects to find saved)."""
    if fuse:
        return swiglu_weighted(pre, p, limit)
    act = swiglu_act_(pre, limit)
    return act if p is None else act.mul_(p)


def swiglu_backward(d_act: torch.Tensor, pre: torch.Tensor, p: torch.Tensor | None, limit: float | None,
                    fuse: bool):
    """Backward of ``swiglu_forward`` (the same ``fuse``) from d(output) [n, f] (overwritten
    eagerly) -> (d(gate|up) [n, 2f], d p [n] | None, the output [n, f]). The SwiGLU is
    recomputed from the saved pre-activations."""
    if fuse:
        return swiglu_weighted_backward(d_act, pre, p, limit)
    gate, up, silu, act = swiglu_recompute(pre)
    dp = None
    if p is not None:
        dp = torch.linalg.vecdot(d_act, act)
        act.mul_(p)
        d_act.mul_(p)
    return swiglu_pre_grad(d_act, gate, up, silu, limit), dp, act


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
# SwiGLU limit runs torch's grouped GEMM instead: the same products (bitwise, on CPU fp32) in two
# ops instead of two per expert; at 16 pairs over 8 layers of 16 experts ~8-10% faster than the loop
# (1 and 2 threads, docs/performance.md); larger batches were not measured, so they keep the loop
DECODE_ROWS = 64


class _LoopExperts(torch.autograd.Function):
    """Blocks of consecutive experts (``expert_blocks``): per block, per-expert GEMMs and one
    SwiGLU pass over the block's rows (fused with ``fuse``), so the
    rows stay in cache while the number of small ops stays low. Saves only the gate|up
    pre-activations [S, 2f]; recomputes the SwiGLU and re-gathers the input rows in backward.
    Eagerly with a ``limit`` the saved pre-activations are the clamped ones: a value at the
    bound was clamped (or lay exactly on it, a measure-zero case) and gets no gradient; the
    fused pass clamps on the fly and masks the same entries."""

    @staticmethod
    def run(x, idx, probs, w1, w2, counts, out_rows, limit, fuse):
        """The forward's maths -> (out [out_rows, h], gate|up pre-activations [S, 2f]); called
        directly where nothing needs a gradient (decoding: no autograd node per layer)."""
        out = x.new_zeros(out_rows, x.size(-1))
        pre = x.new_empty(idx.numel(), w1.size(1))    # gate|up pre-activations [S, 2f]
        w1t, w2t = w1.transpose(1, 2).unbind(0), w2.transpose(1, 2).unbind(0)  # E x [h, 2f], E x [f, h] views
        for blk, experts in expert_blocks(counts, BLOCK_ROWS):
            rows, pre_b = x.index_select(0, idx[blk]), pre[blk]
            _expert_mms(rows, w1t, experts, pre_b)
            act = swiglu_forward(pre_b, None if probs is None else probs[blk, None], limit, fuse)
            y = torch.empty_like(rows)
            _expert_mms(act, w2t, experts, y)
            out.index_add_(0, idx[blk], y)
        return out, pre

    @staticmethod
    def forward(ctx, x, idx, probs, w1, w2, counts, out_rows, limit, fuse):
        ctx.fuse = fuse
        out, pre = _LoopExperts.run(x, idx, probs, w1, w2, counts, out_rows, limit, fuse)
        ctx.counts, ctx.limit = counts, limit
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
                                             ctx.limit, ctx.fuse)
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
    def run(y, x, w1, w2, gate_w, limit, fuse):
        """The forward's maths -> (output, pre-activations, gate p | None)."""
        pre = torch.mm(x, w1.t())
        p = None if gate_w is None else torch.sigmoid(torch.mm(x, gate_w.t()))  # [T, 1]
        act = swiglu_forward(pre, p, limit, fuse)
        return torch.addmm(y, act, w2.t()), pre, p

    @staticmethod
    def forward(ctx, y, x, w1, w2, gate_w, limit, fuse):
        ctx.fuse, ctx.limit = fuse, limit
        out, pre, p = _SharedSwiGLUAdd.run(y, x, w1, w2, gate_w, limit, fuse)
        ctx.save_for_backward(x, w1, w2, gate_w, pre, p)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, gate_w, pre, p = ctx.saved_tensors
        need = ctx.needs_input_grad
        dout = dout.contiguous()
        d_pre, dp, act = swiglu_backward(torch.mm(dout, w2), pre, p, ctx.limit, ctx.fuse)
        dw2 = torch.mm(dout.t(), act) if need[3] else None
        dw1 = torch.mm(d_pre.t(), x) if need[2] else None
        dx = torch.mm(d_pre, w1)
        dgate_w = None
        if p is not None:
            dlogit = dp.unsqueeze(1).mul_(p * (1 - p))  # d(x g^T)
            dgate_w = torch.mm(dlogit.t(), x) if need[4] else None
            dx.addmm_(dlogit, gate_w)
        return dout, dx, dw1, dw2, dgate_w, None, None


def shared_swiglu_add(y, x, w1, w2, gate_w=None, limit: float | None = None, fuse: bool = False) -> torch.Tensor:
    """y + [sigmoid(x gate_w^T)] * SwiGLU(x) for y, x [T, h] (see ``_SharedSwiGLUAdd``)."""
    return call(_SharedSwiGLUAdd, y, x, w1, w2, gate_w, limit, fuse)


def swiglu_experts_loop(x, idx, counts: Sequence[int], probs, w1, w2, out_rows: int,
                        limit: float | None = None, fuse: bool = False) -> torch.Tensor:
    if probs is not None:
        probs = probs.to(x.dtype)
    if (not torch.is_grad_enabled() and limit is None and idx.numel() <= DECODE_ROWS
            and _rows_aligned(x, x.size(-1), w2.size(-1)) and grouped_mm_support(x.device, x.dtype) is None):
        return swiglu_experts_grouped_mm(x, idx, counts, probs, w1, w2, out_rows, limit)
    return call(_LoopExperts, x, idx, probs, w1, w2, list(counts), out_rows, limit, fuse)


_FUNCS = {"reference": swiglu_experts_reference, "grouped_mm": swiglu_experts_grouped_mm,
          "loop": swiglu_experts_loop}


def resolve_kernel(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel to run for a configured name (``auto`` or one of KERNELS)."""
    if name == "auto":
        if device.type != "cpu" and grouped_mm_support(device, dtype) is None:
            return "grouped_mm"
        return "loop"
    if name == "grouped_mm":
        why = grouped_mm_support(device, dtype)
        if why is not None:
            raise ConfigError(f"model.moe.expert_kernel='grouped_mm' is unavailable here ({why}); "
                              f"allowed: auto, loop, reference")
    elif name not in _FUNCS:
        raise ConfigError(f"model.moe.expert_kernel={name!r} is invalid: allowed: auto, {', '.join(KERNELS)}")
    return name


def swiglu_experts(kernel: str, x, idx, counts, probs, w1, w2, out_rows: int, limit: float | None = None,
                   fuse: bool = False) -> torch.Tensor:
    """Dispatch to a kernel by name (see the module docstring for the contract); ``fuse``: the
    loop kernel's SwiGLU passes run compiled (``megamoe.fusion``)."""
    if len(counts) != w1.size(0):
        raise ValueError(f"counts has {len(counts)} entries for {w1.size(0)} experts")
    if sum(counts) != idx.numel():
        raise ValueError(f"counts sum to {sum(counts)} but {idx.numel()} rows were given")
    return _FUNCS[resolve_kernel(kernel, x.device, x.dtype)](x, idx, counts, probs, w1, w2, out_rows, limit, fuse)


