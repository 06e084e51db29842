"""Autograd-correct collectives over an explicit group; ``group=None`` means no communication.

The pairs follow Megatron's conjugate operators:

============================  =======================  ==========================
function                      forward                  backward
============================  =======================  ==========================
``copy_to``                   identity                 all-reduce
``reduce_from``               all-reduce               identity
``gather_from``               all-gather (dim)         keep own chunk
``scatter_to``                keep own chunk (dim)     all-gather
``gather_reduce_scatter``     all-gather (dim)         reduce-scatter
``reduce_scatter_to``         reduce-scatter (dim)     all-gather
``all_to_all``                all-to-all (splits)      all-to-all (reversed)
============================  =======================  ==========================

``gather_from`` is for outputs every rank then uses identically (its gradient is the same
on all ranks); ``gather_reduce_scatter`` is for inputs each rank multiplies with its own
weight shard (sequence parallelism), whose gradients must be summed.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist

from megamoe.parallel.groups import group_rank, group_size

# ---- latency recording (for the training monitor) ----------------------------------------

_RECORDER: ContextVar = ContextVar("megamoe_comm_recorder", default=None)
_TAG: ContextVar = ContextVar("megamoe_comm_tag", default="model")


class LatencyRecorder:
    """Collects seconds of all-gather / all-to-all calls by ``kind/tag`` while active.

    Tags come from ``tag_scope`` (the model sets one per layer); a collective issued in
    backward carries the tag of its forward. The trainer activates a recorder on sampled
    steps only; when none is active a collective runs no timing code at all.

    A CUDA collective is bracketed by two timing events on the current stream and read back
    in ``drain`` (at log time, when the step's work is long done): timing never waits for the
    device, so it does not serialise communication with compute. On CPU, where gloo
    collectives return when complete, host clocks are exact.
    """

    def __init__(self):
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def active(self):
        token = _RECORDER.set(self)
        try:
            yield self
        finally:
            _RECORDER.reset(token)

    def time(self, kind: str, tag: str | None, fn, x: torch.Tensor, *args) -> torch.Tensor:
        """``fn(x, *args)``, recording its latency under ``kind/tag``."""
        key = f"{kind}/{tag or current_tag()}"
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(x, *args)
            end.record()
            self._pending.append((key, start, end))
            return out
        t0 = time.perf_counter()
        out = fn(x, *args)
        self.samples[key].append(time.perf_counter() - t0)
        return out

    def drain(self) -> dict[str, list[float]]:
        """Samples since the last drain, in seconds. Reads the CUDA events back (waiting for
        the last of them, which the finished step has normally passed already)."""
        for key, start, end in self._pending:
            end.synchronize()
            self.samples[key].append(start.elapsed_time(end) / 1e3)
        self._pending = []
        out, self.samples = dict(self.samples), defaultdict(list)
        return out


@contextmanager
def tag_scope(tag: str):
    token = _TAG.set(tag)
    try:
        yield
    finally:
        _TAG.reset(token)


def current_tag() -> str:
    return _TAG.get()


def _timed(kind: str, tag: str | None, fn, *args):
    rec = _RECORDER.get()
    return fn(*args) if rec is None else rec.time(kind, tag, fn, *args)


# ---- raw collectives (no autograd) -------------------------------------------------------

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group, tag: str | None = None) -> torch.Tensor:
    return _timed("all_gather", tag, _all_gather_impl, x, dim, group)


def _all_gather_impl(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if x.size(dim) % n:
        raise ValueError(f"cannot split dim {dim} of size {x.size(dim)} over {n} ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if x.size(dim) % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.size(dim)} over {n} ranks")
    parts = [p.contiguous() for p in x.chunk(n, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                tag: str | None = None) -> torch.Tensor:
    """x: [sum(in_splits), ...] -> [sum(out_splits), ...] along dim 0."""
    return _timed("all_to_all", tag, _all_to_all_impl, x, out_splits, in_splits, group)


def _all_to_all_impl(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return out


# ---- autograd functions ------------------------------------------------------------------

class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.dim, ctx.group), None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.tag = dim, group, current_tag()
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group, ctx.tag), None, None


class _GatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.tag = dim, group, current_tag()
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group, ctx.tag), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group, ctx.tag = (out_splits, in_splits), group, current_tag()
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all(g, in_splits, out_splits, ctx.group, ctx.tag), None, None, None


# ---- public API: no-ops for a group of one -----------------------------------------------

def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFrom.apply(x, group)


def gather_from(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFrom.apply(x, dim, group)


def scatter_to(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterTo.apply(x, dim, group)


def gather_reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherReduceScatter.apply(x, dim, group)


def reduce_scatter_to(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterTo.apply(x, dim, group)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return x if group_size(group) == 1 else _AllToAll.apply(x, out_splits, in_splits, group)


def all_gather_tensor(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather outside autograd (metrics, checkpoint gathering)."""
    return x if group_size(group) == 1 else _all_gather(x.detach(), dim, group)


def all_reduce_tensor(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce outside autograd (gradients, metrics)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x
