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
``all_to_all_start/wait``     all-to-all, async        reverse all-to-all, async
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

from megamoe.parallel.groups import group_name, group_rank, group_size

# ---- latency recording (for the training monitor) ----------------------------------------

_RECORDER: ContextVar = ContextVar("megamoe_comm_recorder", default=None)
_TAG: ContextVar = ContextVar("megamoe_comm_tag", default="model")


def size_bucket(nbytes: int) -> str:
    """The message-size bucket of ``nbytes``: the power of 4 at or above it, at least 1KiB
    (``"1KiB"``, ``"4KiB"``, ..., ``"16MiB"``; a bucket holds sizes above the one below it)."""
    top = 1024
    while top < nbytes:
        top *= 4
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if top >= size:
            return f"{top // size}{unit}"
    return f"{top // 1024}KiB"


def sample_key(kind: str, group, nbytes: int, tag: str | None = None) -> str:
    """``kind/group/bucket/tag`` (e.g. ``all_reduce/dp_cp/4MiB/grad_sync``): how samples are keyed."""
    return f"{kind}/{group_name(group)}/{size_bucket(nbytes)}/{tag or current_tag()}"


def split_key(key: str) -> tuple[str, str, str, str]:
    """``sample_key``'s parts: kind, group, bucket, tag."""
    kind, group, bucket, tag = key.split("/", 3)
    return kind, group, bucket, tag


class LatencyRecorder:
    """Collects (seconds, bytes) of every collective megamoe issues while active, keyed by
    ``sample_key``: operation kind, group name (``group_name``), message-size bucket and tag.

    Tags come from ``tag_scope`` (the model sets one per layer, the trainer one per phase such
    as ``grad_sync``); a collective issued in backward carries the tag of its forward. The
    trainer activates a recorder on sampled steps only; when none is active a collective runs
    no timing code at all.

    A CUDA collective is bracketed by two timing events on the current stream and read back
    in ``drain`` (at log time, when the step's work is long done): timing never waits for the
    device, so it does not serialise communication with compute. On CPU, where gloo
    collectives return when complete, host clocks are exact. Message sizes are the whole
    buffer: the gathered output of an all-gather, the input of a reduce-scatter, the sent
    tokens of an all-to-all, the tensor of an all-reduce or broadcast, the sum of a batch of
    pipeline sends and receives.
    """

    def __init__(self):
        self.samples: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self._pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def active(self):
        token = _RECORDER.set(self)
        try:
            yield self
        finally:
            _RECORDER.reset(token)

    def time(self, kind: str, group, nbytes: int, tag: str | None, fn, x: torch.Tensor, *args):
        """``fn(x, *args)``, recording its latency under ``sample_key(kind, group, nbytes, tag)``."""
        key = sample_key(kind, group, nbytes, tag)
        if x.is_cuda:
            start = self.event_now()
            out = fn(x, *args)
            self.add_events(key, nbytes, start, self.event_now())
            return out
        t0 = time.perf_counter()
        out = fn(x, *args)
        self.add(key, nbytes, time.perf_counter() - t0)
        return out

    @staticmethod
    def event_now() -> torch.cuda.Event:
        """A timing event recorded now on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, key: str, nbytes: int, seconds: float) -> None:
        self.samples[key].append((seconds, nbytes))

    def add_events(self, key: str, nbytes: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """A CUDA sample, read back at the next ``drain``."""
        self._pending.append((key, nbytes, start, end))

    def drain(self) -> dict[str, list[tuple[float, int]]]:
        """``{key: [(seconds, bytes), ...]}`` since the last drain. Reads the CUDA events back
        (waiting for the last of them, which the finished step has normally passed already)."""
        for key, nbytes, start, end in self._pending:
            end.synchronize()
            self.samples[key].append((start.elapsed_time(end) / 1e3, nbytes))
        self._pending = []
        out, self.samples = dict(self.samples), defaultdict(list)
        return out


class P2PTimer:
    """One batch of point-to-point transfers on a sampled step, recorded as ``send_recv`` when
    ``finish`` is called: the host time between construction and ``pause`` (issuing) plus
    between ``resume`` and ``finish`` (waiting) on CPU; on CUDA, events from construction to
    ``finish`` on the current stream. Made by ``p2p_timer``."""

    def __init__(self, rec: LatencyRecorder, key: str, nbytes: int, cuda: bool):
        self.rec, self.key, self.nbytes, self.seconds = rec, key, nbytes, 0.0
        self.start = rec.event_now() if cuda else None
        self._t = time.perf_counter()

    def pause(self) -> None:
        self.seconds += time.perf_counter() - self._t

    def resume(self) -> None:
        self._t = time.perf_counter()

    def finish(self) -> None:
        if self.start is not None:
            self.rec.add_events(self.key, self.nbytes, self.start, self.rec.event_now())
        else:
            self.rec.add(self.key, self.nbytes, self.seconds + time.perf_counter() - self._t)


def p2p_timer(group, tensors: list[torch.Tensor], tag: str | None = None) -> P2PTimer | None:
    """A ``P2PTimer`` for sending/receiving ``tensors`` over ``group`` on a sampled step, else
    None (no timing code at all)."""
    rec = _RECORDER.get()
    if rec is None:
        return None
    nbytes = sum(_nbytes(t) for t in tensors)
    return P2PTimer(rec, sample_key("send_recv", group, nbytes, tag), nbytes, any(t.is_cuda for t in tensors))


def active_recorder() -> LatencyRecorder | None:
    """The recorder of a sampled step, else None."""
    return _RECORDER.get()


@contextmanager
def tag_scope(tag: str):
    if torch.compiler.is_compiling():  # a graph cannot set a ContextVar: a compiled region keeps its caller's tag
        yield
        return
    token = _TAG.set(tag)
    try:
        yield
    finally:
        _TAG.reset(token)


def current_tag() -> str:
    return _TAG.get()


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _timed(kind: str, group, nbytes: int, tag: str | None, fn, *args):
    rec = _RECORDER.get()
    return fn(*args) if rec is None else rec.time(kind, group, nbytes, tag, fn, *args)


# ---- raw collectives (no autograd) -------------------------------------------------------

def _all_reduce(x: torch.Tensor, group, tag: str | None = None) -> torch.Tensor:
    x = x.contiguous().clone()
    _timed("all_reduce", group, _nbytes(x), tag, _all_reduce_impl, x, group)
    return x


def _all_reduce_impl(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(x, op=op, group=group)


def _all_gather(x: torch.Tensor, dim: int, group, tag: str | None = None) -> torch.Tensor:
    return _timed("all_gather", group, _nbytes(x) * group_size(group), tag, _all_gather_impl, x, dim, group)


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


def _reduce_scatter(x: torch.Tensor, dim: int, group, tag: str | None = None) -> torch.Tensor:
    n = group_size(group)
    if x.size(dim) % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.size(dim)} over {n} ranks")
    return _timed("reduce_scatter", group, _nbytes(x), tag, _reduce_scatter_impl, x, dim, group)


def _reduce_scatter_impl(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [p.contiguous() for p in x.chunk(group_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                tag: str | None = None) -> torch.Tensor:
    """x: [sum(in_splits), ...] -> [sum(out_splits), ...] along dim 0."""
    return _timed("all_to_all", group, _nbytes(x), tag, _all_to_all_impl, x, out_splits, in_splits, group)


def _all_to_all_impl(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return out


# ---- autograd functions ------------------------------------------------------------------

class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.tag = group, current_tag()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group, ctx.tag), None


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
        ctx.dim, ctx.group, ctx.tag = dim, group, current_tag()
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group, ctx.tag), None, None


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


class Pending:
    """A collective in flight (``all_to_all_start``, ``all_reduce_start``): its output buffer is
    not to be read before ``wait``; the time from issue to completion is recorded at the wait."""

    def __init__(self, work, key: str | None, nbytes: int, keep: torch.Tensor | None = None):
        self.work, self.key, self.nbytes, self.t0 = work, key, nbytes, time.perf_counter()
        self.rec = _RECORDER.get()
        self.keep = keep  # the input, alive until the collective is done
        self.a2a = None  # an all-to-all's (out_splits, in_splits, group)
        self.reverse = None  # its backward in flight: (buffer, Pending)

    def wait(self) -> None:
        self.work.wait()
        self.keep = None
        if self.rec is not None:
            self.rec.add(self.key, self.nbytes, time.perf_counter() - self.t0)


def _all_to_all_issue(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                      tag: str | None = None) -> tuple[torch.Tensor, Pending]:
    """``_all_to_all`` issued asynchronously: (its output buffer, the pending collective)."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group,
                                  async_op=True)
    return out, Pending(work, sample_key("all_to_all", group, _nbytes(x), tag), _nbytes(x), keep=x)


class _AllToAllStart(torch.autograd.Function):
    """Issue the all-to-all and return its (unfilled) output buffer. Backward: the reverse
    all-to-all, which ``_Wait``'s backward issued asynchronously (backward runs the two nodes in
    the reverse order of forward, so the work between them overlaps it again); waited here."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, box):
        ctx.splits, ctx.group, ctx.tag = (out_splits, in_splits), group, current_tag()
        out, pending = _all_to_all_issue(x, out_splits, in_splits, group)
        pending.a2a = (out_splits, in_splits, group)  # for _Wait's backward
        ctx.pending = pending
        box.append(pending)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        started, ctx.pending.reverse = ctx.pending.reverse, None
        if started is None:  # (the output's gradient did not come through _Wait)
            return _all_to_all(g, in_splits, out_splits, ctx.group, ctx.tag), None, None, None, None
        buffer, pending = started
        pending.wait()
        return buffer, None, None, None, None


class _Wait(torch.autograd.Function):
    """Wait for the all-to-all; backward: issue its reverse asynchronously (``_AllToAllStart``)."""

    @staticmethod
    def forward(ctx, out, pending):
        ctx.pending, ctx.tag = pending, current_tag()
        pending.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits, group = ctx.pending.a2a
        buffer, pending = _all_to_all_issue(g, in_splits, out_splits, group, ctx.tag)
        ctx.pending.reverse = (buffer, pending)
        return g, None


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


def all_to_all_start(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """``all_to_all`` issued asynchronously: (output buffer, pending); read the buffer only
    through ``all_to_all_wait(buffer, pending)``. The backward mirrors it: the reverse all-to-all
    is issued asynchronously where the wait was and waited where the issue was, so what ran in
    between in forward overlaps it in backward too (autograd runs nodes in reverse creation order)."""
    if group_size(group) == 1:
        return x, None
    box: list = []
    out = _AllToAllStart.apply(x, out_splits, in_splits, group, box)
    return out, box[0]


def all_to_all_wait(out: torch.Tensor, pending) -> torch.Tensor:
    """The output of ``all_to_all_start`` once it has arrived."""
    return out if pending is None else _Wait.apply(out, pending)


def all_gather_tensor(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather outside autograd (metrics, checkpoint gathering)."""
    return x if group_size(group) == 1 else _all_gather(x.detach(), dim, group)


def all_reduce_tensor(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce outside autograd (gradients, metrics)."""
    if group_size(group) > 1:
        _timed("all_reduce", group, _nbytes(x), None, _all_reduce_impl, x, group, op)
    return x


def all_reduce_start(x: torch.Tensor, group, tag: str | None = None) -> Pending | None:
    """``all_reduce_tensor`` issued asynchronously (in place): ``x`` holds the sum only after
    ``pending.wait()``; None for a group of one (nothing to wait for). Timed from issue to wait."""
    if group_size(group) == 1:
        return None
    work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, sample_key("all_reduce", group, _nbytes(x), tag), _nbytes(x))


def broadcast_tensor(x: torch.Tensor, src: int, group) -> torch.Tensor:
    """In-place broadcast from the group's rank ``src`` outside autograd (optimizer updates)."""
    if group_size(group) > 1:
        _timed("broadcast", group, _nbytes(x), None, _broadcast_impl, x, src, group)
    return x


def _broadcast_impl(x: torch.Tensor, src: int, group) -> None:
    dist.broadcast(x, src=dist.get_global_rank(group, src), group=group)
