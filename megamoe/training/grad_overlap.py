"""Data-parallel gradient sums launched from backward hooks, overlapped with the rest of the
backward (``train.overlap_grad_reduce``, on by default).

Backward finishes the parameters' gradients from the last layer to the first, so the buckets of
``megamoe.training.grads.plan_buckets`` (the parameters in forward order walked backwards, dense
ones summed over ``dp_cp``, routed experts over ``edp``) fill in launch order. Each bucket owns one
flat buffer per dtype and, from ``start_step`` on, its parameters' ``.grad`` are views of it
(zeroed): backward accumulates every micro-batch in place, as Megatron's grad buffer does, so a
sum needs no copy. In the last micro-batch's backward (``last_backward``: the trainer's loop,
or the pipeline schedule's last backward of each stage) each parameter's post-accumulate-grad
hook first sums a partial gradient over TP/ETP (``mark_partial_grad``: the collective
``finalize_grads`` issues, beside the model's own backward collectives of that group) and marks
it ready; once a bucket and every bucket before it are ready, its sum is issued asynchronously
(``async_op=True``) and the backward goes on. ``finish`` (before the gradient norm, clipping and
the optimizer step) does what the hooks could not: parameters without a gradient in the last
micro-batch (zeros, as ``sync_grads``), the embedding summed over the first and last stage
before its bucket, buckets still waiting; then it waits for every bucket in launch order.

Buckets are launched strictly in plan order, so every rank issues the same collectives in the
same order whatever order its hooks fire in. Each buffer holds exactly the flat tensor
``sync_grads`` (the reference, ``train.overlap_grad_reduce=false``) builds for that bucket:
parameters, losses and gradients equal bitwise (``tests/test_grad_overlap.py``). ZeRO-1 is
unchanged: the optimizer reads the summed gradients, updates what it owns and broadcasts it.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn

from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.sharding import partial_grad_groups
from megamoe.training.grads import BUCKET_ELEMENTS, all_reduce_bucketed, by_dtype, plan_buckets, tied_params


def _flat_views(params: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zeroed buffer [sum numel] laid out as ``_flatten_dense_tensors(grads)``, and each
    parameter's view of it."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    views, at = [], 0
    for p in params:
        views.append(flat[at:at + p.numel()].view_as(p))
        at += p.numel()
    return flat, views


def _weak_ready(ref: weakref.ref):
    def ready(p: torch.Tensor) -> None:
        sync = ref()
        if sync is not None:
            sync._ready(p)
    return ready


class OverlappedGradSync:
    """Per step: ``start_step()``; ``with sync.last_backward(is_last): loss.backward()`` per
    micro-batch; ``finish()``."""

    def __init__(self, parts: list[nn.Module], groups: ParallelGroups, bucket_elements: int = BUCKET_ELEMENTS):
        self.groups = groups
        self.buckets = plan_buckets(parts, groups, bucket_elements)
        self.tied = tied_params(parts, groups)
        self.flats: list[list[torch.Tensor]] = []  # per bucket: its buffer per dtype
        self.view: dict[int, torch.Tensor] = {}  # id(param) -> its gradient's place in a buffer
        self.bucket_of: dict[int, int] = {}
        for i, bucket in enumerate(self.buckets):
            self.flats.append([])
            for same in by_dtype(bucket.params):
                flat, views = _flat_views(same)
                self.flats[-1].append(flat)
                self.view.update({id(p): v for p, v in zip(same, views)})
            self.bucket_of.update({id(p): i for p in bucket.params})
        # the hooks reach this object through a weak reference: a parameter keeps its hooks on the
        # C++ side, where the garbage collector cannot see the cycle parameter -> hook -> self ->
        # parameter, so a bound method would keep every parameter, buffer and process group of a
        # finished trainer alive for the life of the process
        ready = _weak_ready(weakref.ref(self))
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(ready)
        self.armed = False
        self._reset()

    def _reset(self) -> None:
        self.missing = [len(b.params) for b in self.buckets]  # parameters each bucket still waits for
        self.finished: set[int] = set()  # ids of parameters whose gradient a hook completed
        self.launched: list[list] = []  # per launched bucket, its sums in flight

    def start_step(self) -> None:
        """Before the step's first backward: gradients become zeroed views of the buffers."""
        for flats in self.flats:
            for flat in flats:
                flat.zero_()
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = self.view[id(p)]

    @contextmanager
    def last_backward(self, last: bool = True):
        """Around one micro-batch's backward: hooks act only in the step's last one (the gradients
        of earlier micro-batches only accumulate)."""
        self.armed = last
        try:
            yield
        finally:
            self.armed = False

    def _ready(self, p: torch.Tensor) -> None:
        """A parameter's gradient is complete for the step: its partial sums, then its bucket."""
        i = self.bucket_of[id(p)]
        if not self.armed or self.buckets[i].deferred:
            return
        with comm.tag_scope("grad_sync"):
            self._own(p)
            self._sum_partial(p)
            self.finished.add(id(p))
            self.missing[i] -= 1
            while len(self.launched) < len(self.buckets) and self.missing[len(self.launched)] == 0:
                self._launch()

    def _own(self, p: torch.Tensor) -> None:
        """Make ``p.grad`` its buffer view: zeros if it has none, a copy if backward replaced it
        (``start_step`` was skipped, or the gradient was set by hand)."""
        view = self.view[id(p)]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        else:
            return
        p.grad = view

    def _sum_partial(self, p: torch.Tensor) -> None:
        for name in partial_grad_groups(p):  # as finalize_grads
            comm.all_reduce_tensor(p.grad, getattr(self.groups, name))

    def _launch(self) -> None:
        i = len(self.launched)
        pending = [comm.all_reduce_start(flat, self.buckets[i].group, tag="grad_sync") for flat in self.flats[i]]
        self.launched.append([x for x in pending if x is not None])

    def finish(self) -> None:
        """After the step's backward: the rest of the reduction, then wait for all of it."""
        with comm.tag_scope("grad_sync"):
            rest = [p for b in self.buckets[len(self.launched):] for p in b.params if id(p) not in self.finished]
            for p in rest:  # in plan order on every rank; a parameter without a gradient has no partial sum
                had_grad = p.grad is not None
                self._own(p)
                if had_grad:
                    self._sum_partial(p)
            all_reduce_bucketed([p.grad for p in self.tied], self.groups.embd)
            while len(self.launched) < len(self.buckets):
                self._launch()
            for pending in self.launched:
                for x in pending:
                    x.wait()
        self._reset()
