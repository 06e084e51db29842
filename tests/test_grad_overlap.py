"""Data-parallel gradient sums from backward hooks (``train.overlap_grad_reduce``) against the
sums after backward (the reference), on 4 gloo processes, ZeRO-1, two micro-batches per step
(gradients accumulate; the hooks act in the last one), small buckets (many per step):

- EP=2 (dense DP=4, expert DP=2), the spied step: each bucket's sum is issued asynchronously from
  a hook while backward compute (the matmuls) is still to come, and every wait comes after the
  backward, before the gradient norm;
- PP=2 x EP=2 with tied embeddings (the embedding is summed over the first and last stage before
  its bucket: launched after backward);
- LoRA at TP=2+SP x EP=2 (frozen base: only the adapters' buckets; norms' TP-partial sums in hooks).

Losses and every parameter after the steps equal the reference bitwise.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megamoe.core.config import ParallelConfig
from tests.test_trainer_parity import tiny_recipe

STEPS = 3
BUCKET = 4096  # elements: the tiny model's trainable tensors make several buckets (LoRA's adapters: 1024)
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")


class _Trace(TorchDispatchMode):
    """Notes each run of matmuls as one "compute", each asynchronous all-reduce issued ("issue"),
    each wait on one ("wait") and the start of ``finish`` ("finish")."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def note(self, event: str) -> None:
        if not (event == "compute" and self.events and self.events[-1] == "compute"):
            self.events.append(event)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.note("compute")
        return func(*args, **(kwargs or {}))


def _spied_step(trainer, micro) -> list[str]:
    from megamoe.parallel import comm

    trace = _Trace()
    orig_reduce, orig_wait, orig_finish = dist.all_reduce, comm.Pending.wait, trainer.grad_sync.finish

    def all_reduce(*args, async_op=False, **kwargs):
        if async_op:
            trace.note("issue")
        return orig_reduce(*args, async_op=async_op, **kwargs)

    def wait(self):
        trace.note("wait")
        return orig_wait(self)

    def finish():
        trace.note("finish")
        return orig_finish()

    dist.all_reduce, comm.Pending.wait, trainer.grad_sync.finish = all_reduce, wait, finish
    try:
        with trace:
            loss = trainer.train_step(micro)["loss"]
    finally:
        dist.all_reduce, comm.Pending.wait = orig_reduce, orig_wait
        del trainer.grad_sync.finish
    return loss, trace.events


CASES = {"ep2": ParallelConfig(ep=2), "pp2-ep2-tied": ParallelConfig(pp=2, ep=2),
         "lora-tp2sp-ep2": ParallelConfig(tp=2, ep=2, sequence_parallel=True)}


def _recipe(case: str, overlap: bool):
    parallel = CASES[case]
    recipe = tiny_recipe(parallel, steps=STEPS)
    if case == "pp2-ep2-tied":
        recipe.model = dataclasses.replace(recipe.model, tie_embeddings=True)
    if case.startswith("lora"):
        from megamoe.lora import LoRAConfig

        recipe.lora = LoRAConfig(rank=4, alpha=8.0)
    dp = 4 // (parallel.tp * parallel.pp)
    recipe.train = dataclasses.replace(recipe.train, micro_batch_size=1, global_batch_size=2 * dp,
                                       overlap_grad_reduce=overlap,
                                       grad_bucket_size=BUCKET // 4 if recipe.lora else BUCKET)
    return recipe


def overlap_case(case: str) -> dict:
    """The reference run, then the overlapped one (its last step spied at EP=2)."""
    from megamoe.parallel.groups import group_size
    from megamoe.training.trainer import Trainer
    from tests.test_host_sync import _micro

    import time

    runs, events, t0 = {}, None, time.perf_counter()
    for overlap in (False, True):
        trainer = Trainer(_recipe(case, overlap))
        micro = _micro(trainer)
        losses = [trainer.train_step(micro)["loss"] for _ in range(STEPS - 1)]
        if overlap and case == "ep2":
            loss, events = _spied_step(trainer, micro)
        else:
            loss = trainer.train_step(micro)["loss"]
        params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(trainer.chunks) for n, p in c.named_parameters()}
        runs[overlap] = (losses + [loss], params)
    (ref_losses, ref), (losses, got) = runs[False], runs[True]
    sync = trainer.grad_sync
    every = [p for c in trainer.chunks for p in c.parameters()]
    return {"losses": losses == ref_losses, "params": all(torch.equal(got[n], ref[n]) for n in ref),
            "max diff": max((got[n] - ref[n]).abs().max().item() for n in ref), "n_micro": trainer.n_micro,
            "buckets": len(sync.buckets), "reduced": sum(group_size(b.group) > 1 for b in sync.buckets),
            "deferred": sum(b.deferred for b in sync.buckets), "in buckets": sum(len(b.params) for b in sync.buckets),
            "flats": sum(len(f) for b, f in zip(sync.buckets, sync.flats) if group_size(b.group) > 1),
            "trainable": sum(p.requires_grad for p in every), "total": len(every), "events": events,
            "seconds": time.perf_counter() - t0}


def _check_order(events: list[str], flats: int) -> None:
    """Every flat bucket issued asynchronously once; those the backward finished early issued with
    backward matmuls still to come (the last few complete only as backward ends); every wait
    after the backward, in ``finish``."""
    end = events.index("finish")
    issued = [i for i, e in enumerate(events[:end]) if e == "issue"]
    overlapped = [i for i in issued if "compute" in events[i + 1:end]]
    assert len(overlapped) >= max(3, len(issued) - 2), events
    assert events.count("issue") == events.count("wait") == flats, (flats, events)
    assert min(i for i, e in enumerate(events) if e == "wait") > end, events


def test_overlapped_grad_sums_equal_the_reference(pool):
    p = pool(4)
    for case in ("ep2", "pp2-ep2-tied", "lora-tp2sp-ep2"):
        for rank, r in enumerate(p.run(overlap_case, case)):
            where = f"{case} rank {rank}"
            print(where, f"{r['seconds']:.1f} s")
            assert r["n_micro"] == 2, where
            assert r["buckets"] >= 3 and r["reduced"] >= 1, (where, r["buckets"], r["reduced"])
            assert r["losses"] and r["params"], f"{where}: differs from the reference by {r['max diff']:.3g}"
            assert r["in buckets"] == r["trainable"], where
            assert r["deferred"] == (1 if case.startswith("pp2") else 0), where  # the tied embedding's bucket
            if case == "ep2":
                _check_order(r["events"], r["flats"])
            if case.startswith("lora"):
                assert r["trainable"] < r["total"], where  # (the frozen base has no bucket: "in buckets")
