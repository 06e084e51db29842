"""The training-time communication profile: on sampled steps every collective megamoe issues
(all-reduce, reduce-scatter, all-gather, all-to-all, broadcast, pipeline send/recv, the
gradient sync) lands in TensorBoard histograms per group and message size, with a summary in
metrics.jsonl. A spy on ``torch.distributed`` lists the (operation, group) pairs that really
communicated during the sampled steps; each must appear in the event file."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from megamoe.core.config import ParallelConfig
from tests.test_trainer_parity import tiny_recipe

# torch.distributed function -> the recorder's operation kind
_SPIED = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
          "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


class _Spy:
    """Wraps the ``torch.distributed`` collectives, ``isend``/``irecv`` and ``P2POp`` to note
    (kind, group name) of every call made while a recorder is active (sampled steps)."""

    def __init__(self):
        from megamoe.parallel import comm
        from megamoe.parallel.groups import group_name

        self.seen: set[tuple[str, str]] = set()
        self.undo = []
        for fn, kind in _SPIED.items():
            orig = getattr(dist, fn)

            def wrapper(*args, _orig=orig, _kind=kind, **kwargs):
                if comm.active_recorder() is not None:
                    self.seen.add((_kind, group_name(kwargs.get("group"))))
                return _orig(*args, **kwargs)

            setattr(dist, fn, wrapper)
            self.undo.append((dist, fn, orig))
        # point-to-point sends and receives: the ring's plain isend/irecv, and those a batch of
        # P2POps issues; c10d's names too, which P2POp checks its op against
        from torch.distributed import distributed_c10d as c10d

        for fn in ("isend", "irecv"):
            orig = getattr(dist, fn)

            def p2p(*args, _orig=orig, **kwargs):
                if comm.active_recorder() is not None:
                    group = kwargs.get("group", args[2] if len(args) > 2 else None)
                    self.seen.add(("send_recv", group_name(group)))
                return _orig(*args, **kwargs)

            for owner in (dist, c10d):
                self.undo.append((owner, fn, getattr(owner, fn)))
                setattr(owner, fn, p2p)
        init = dist.P2POp.__init__

        def p2p_init(op, *args, _init=init, **kwargs):
            _init(op, *args, **kwargs)
            if comm.active_recorder() is not None:
                self.seen.add(("send_recv", group_name(op.group)))

        dist.P2POp.__init__ = p2p_init
        self.undo.append((dist.P2POp, "__init__", init))

    def restore(self) -> None:
        for owner, name, orig in reversed(self.undo):
            setattr(owner, name, orig)


def sampled_run(parallel: ParallelConfig, log_dir: str, zero1: bool) -> list:
    """Two steps, both sampled, logged at step 2; the (kind, group) pairs this rank issued."""
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer

    recipe = tiny_recipe(parallel, steps=2)
    recipe.optim.zero1 = zero1
    recipe.logging.latency_interval, recipe.logging.interval = 1, 2
    trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
    spy = _Spy()
    try:
        trainer.fit(log_dir)
    finally:
        spy.restore()
    return sorted(spy.seen)


def read_events(log_dir: str) -> tuple[set[tuple[str, str]], dict, dict]:
    """(kind, group) pairs of the ``comm_ms`` histograms, the histograms, the step-2 JSONL line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    hists = {t: acc.Histograms(t)[-1] for t in acc.Tags()["histograms"]}
    pairs = {tuple(t.split("/")[1:3]) for t in hists if t.startswith("comm_ms/")}
    lines = [json.loads(x) for x in open(f"{log_dir}/metrics.jsonl")]
    return pairs, hists, lines[-1]


LAYOUTS = {
    # TP=2 with sequence parallelism: gathers, reduce-scatters and all-reduces over tp; two
    # pipeline stages sending activations and gradients; norms over mp and emp
    "tp2_sp_pp2": (ParallelConfig(tp=2, sequence_parallel=True, pp=2), False,
                   {("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_reduce", "tp"),
                    ("send_recv", "pp"), ("all_reduce", "mp"), ("all_reduce", "emp"), ("all_reduce", "world")}),
    # data x expert parallel: tokens all-to-all over ep, dense gradients over dp_cp, ZeRO-1
    # owners broadcasting their updates
    "dp2_ep2_pp2": (ParallelConfig(ep=2, pp=2), True,
                    {("all_to_all", "ep"), ("all_reduce", "dp_cp"), ("broadcast", "dp_cp"), ("send_recv", "pp"),
                     ("all_reduce", "world")}),
    # context parallelism: ring attention passes K/V blocks around cp, linear attention
    # gathers and reduce-scatters over it; dense gradients over dp_cp, expert ones over edp
    "cp2_dp2": (ParallelConfig(cp=2), False,
                {("send_recv", "cp"), ("all_gather", "cp"), ("reduce_scatter", "cp"), ("all_reduce", "dp_cp"),
                 ("all_reduce", "edp"), ("all_reduce", "world")}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_communicating_group_is_in_the_histograms(pool, tmp_path, name):
    parallel, zero1, expected = LAYOUTS[name]
    seen = {tuple(p) for rank in pool(4).run(sampled_run, parallel, str(tmp_path), zero1) for p in rank}
    assert expected <= seen, (expected - seen, seen)  # the layout really uses them
    pairs, hists, line = read_events(str(tmp_path))
    # nothing that communicated escaped the recorder, and it recorded nothing that did not
    assert seen == pairs, (seen ^ pairs)
    for tag, event in hists.items():
        if tag.startswith("comm_ms/"):
            assert event.step == 2 and event.histogram_value.num > 0 and event.histogram_value.min >= 0, tag
    # the gradient sync keeps its own phase tag; size buckets name powers of 4 from 1KiB
    assert any(t.startswith("latency_ms/all_reduce/grad_sync") for t in hists), sorted(hists)
    assert all(t.split("/")[3].endswith(("KiB", "MiB", "GiB")) for t in hists if t.startswith("comm_ms/"))
    # metrics.jsonl: calls, MiB and latency percentiles per operation and group
    for kind, group in seen:
        key = f"comm/{kind}/{group}"
        assert line[f"{key}/calls"] >= 1 and line[f"{key}/mib"] > 0, key
        assert 0 <= line[f"{key}/p50_ms"] <= line[f"{key}/p99_ms"], key


def ring_step_sampled() -> dict:
    """One context-parallel ring transfer (the K/V blocks of ring attention) on the cp group,
    once outside and once inside a sampled step."""
    import torch

    from megamoe.layers.ops.attention.context import _RingTransfer
    from megamoe.parallel import comm
    from megamoe.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(cp=2))
    rank = dist.get_rank()
    block = torch.full((300,), float(rank))  # 1200 bytes each way
    _RingTransfer([block], groups.cp).wait()  # no recorder: nothing timed
    rec = comm.LatencyRecorder()
    with rec.active():
        got = _RingTransfer([block], groups.cp).wait()[0]
    return {"got": got[0].item(), "samples": {k: [n for _, n in v] for k, v in rec.drain().items()}}


def test_context_parallel_ring_is_timed_on_the_cp_group(pool):
    for rank, out in enumerate(pool(2).run(ring_step_sampled)):
        assert out["got"] == float(1 - rank)  # the previous rank's block
        assert out["samples"] == {"send_recv/cp/4KiB/ring": [2400]}  # sent + received


def test_size_buckets():
    from megamoe.parallel.comm import size_bucket

    assert [size_bucket(n) for n in (1, 1024, 1025, 4096, 5000, 1 << 20, (1 << 20) + 1, 3 << 30)] == \
        ["1KiB", "1KiB", "4KiB", "4KiB", "16KiB", "1MiB", "4MiB", "4GiB"]
