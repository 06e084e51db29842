"""Instrumentation stays off the hot path: timing only on sampled steps (none at all when off),
never a device synchronize around a collective, MoE reports only on logging steps."""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import ParallelConfig
from tests.test_trainer_parity import tiny_recipe


class _Counting:
    """Replaces ``owner.name`` by a wrapper counting its calls (``undo()`` restores it)."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.orig, self.calls = owner, name, getattr(owner, name), 0

        def wrapper(*args, **kwargs):
            self.calls += 1
            return self.orig(*args, **kwargs)

        setattr(owner, name, wrapper)

    def undo(self) -> None:
        setattr(self.owner, self.name, self.orig)


def counted_run(latency_interval: int, log_dir: str) -> dict:
    """Four steps at TP=2+SP, EP=2 (all-gathers and all-to-alls in every layer), logging every
    second step; counts, per step, the recorder's timing calls and the MoE reports."""
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.parallel import comm
    from megamoe.training.trainer import Trainer

    recipe = tiny_recipe(ParallelConfig(tp=2, sequence_parallel=True, ep=2, etp=1), steps=4)
    recipe.logging.interval, recipe.logging.latency_interval = 2, latency_interval
    counters = [_Counting(comm.LatencyRecorder, "time"), _Counting(torch.cuda, "synchronize"),
                _Counting(Trainer, "moe_report")]
    timing, sync, report = counters
    try:
        trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
        per_step, reports = [], []
        trainer.after_step_hooks.append(lambda t: per_step.append(timing.calls))
        orig_report = Trainer.moe_report
        Trainer.moe_report = lambda t: (reports.append(t.step), orig_report(t))[1]
        try:
            trainer.fit(log_dir)
        finally:
            Trainer.moe_report = orig_report
    finally:
        for c in reversed(counters):
            c.undo()
    return {"timing_per_step": per_step, "synchronize": sync.calls, "report_steps": reports,
            "recorder": trainer.recorder is not None}


def test_latency_off_runs_no_timing_code(pool, tmp_path):
    for out in pool(2).run(counted_run, 0, str(tmp_path)):
        assert not out["recorder"]
        assert out["timing_per_step"] == [0, 0, 0, 0]
        assert out["report_steps"] == [2, 4]  # the MoE report on logging steps only


def test_latency_sampled_steps_only_and_no_synchronize(pool, tmp_path):
    for out in pool(2).run(counted_run, 2, str(tmp_path)):
        t = out["timing_per_step"]  # cumulative count of timed collectives after each step
        assert t[0] == 0 and t[1] > 0 and t[2] == t[1] and t[3] == 2 * t[1], t
        assert out["synchronize"] == 0
        assert out["report_steps"] == [2, 4]


def timed_collectives_pretending_cuda() -> dict:
    """With ``torch.cuda.is_available()`` forced true, timed all-gathers and all-to-alls
    (forward and backward) still issue no ``torch.cuda.synchronize``."""
    import torch.distributed as dist

    from megamoe.parallel import comm

    sync = _Counting(torch.cuda, "synchronize")
    avail, torch.cuda.is_available = torch.cuda.is_available, lambda: True
    try:
        rec = comm.LatencyRecorder()
        x = torch.randn(4, 3, requires_grad=True)
        with rec.active(), comm.tag_scope("layer7"):
            y = comm.gather_reduce_scatter(x, 0, dist.group.WORLD)
            z = comm.all_to_all(y, [4, 4], [4, 4], dist.group.WORLD)
            z.square().sum().backward()
    finally:
        torch.cuda.is_available = avail
        sync.undo()
    return {"synchronize": sync.calls, "samples": {k: len(v) for k, v in rec.drain().items()}}


def test_timed_collectives_issue_no_device_synchronize(pool):
    for out in pool(2).run(timed_collectives_pretending_cuda):
        assert out["synchronize"] == 0
        # forward all-gather; all-to-all forward and backward; the backward reduce-scatter, all
        # keyed kind/group/size bucket/tag
        assert out["samples"] == {"all_gather/world/1KiB/layer7": 1, "all_to_all/world/1KiB/layer7": 2,
                                  "reduce_scatter/world/1KiB/layer7": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timing_uses_events_without_synchronizing():
    from megamoe.parallel import comm

    rec = comm.LatencyRecorder()
    x = torch.randn(512, 512, device="cuda")
    torch.cuda.synchronize()
    sync = _Counting(torch.cuda, "synchronize")
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        with rec.active(), comm.tag_scope("layer0"):
            y = comm._timed("all_gather", None, 512 * 512 * 4, None, lambda a: a @ a, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        sync.undo()
    assert sync.calls == 0
    samples = rec.drain()
    key = "all_gather/world/1MiB/layer0"  # a 1MiB tensor; group None reads as world
    assert list(samples) == [key] and len(samples[key]) == 1
    assert samples[key][0][0] > 0 and samples[key][0][1] == 512 * 512 * 4
    torch.testing.assert_close(y, x @ x)
