"""The shared expert overlapped with the MoE all-to-alls (model.moe.shared_expert_overlap), EP=2 on
2 gloo processes: its fc1 runs while the rows' and weights' dispatch all-to-alls are in flight,
its fc2 while the combine's is; backward mirrors it (each reverse all-to-all issued asynchronously
where forward waited, the shared expert's backward, then waited). A spy records the order of
issues, waits and the shared expert's linears in forward and backward; outputs, the loss and every
gradient equal the run without overlap bitwise on the local backend (the CPU backend's fused
shared expert accumulates into the routed output, which overlap cannot wait for: rel 1e-6)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megamoe.core.config import ModelConfig, MoEConfig, ParallelConfig
from tests.numerics import rel_err
from tests.test_moe_parallel import CONFIGS, H, batches


def _layer(overlap: bool, backend: str, groups):
    from megamoe.layers.mlp.moe import MoELayer
    from megamoe.model.language_model import build_context
    from megamoe.model.weights import initialize

    cfg = ModelConfig(hidden_size=H, layout="Ae", backend=backend,
                      moe=MoEConfig(**dict(CONFIGS["softmax"], shared_expert_overlap=overlap)))
    layer = MoELayer(cfg.moe, build_context(cfg, groups), 0)
    initialize(layer, groups, 0)
    return layer


def _spy(events: list):
    """Note every all-to-all issue (sync or async) and wait."""
    from megamoe.parallel import comm

    orig_a2a, orig_wait = dist.all_to_all_single, comm.Pending.wait

    def a2a(*args, async_op=False, **kwargs):
        events.append("issue async" if async_op else "all_to_all")
        return orig_a2a(*args, async_op=async_op, **kwargs)

    def wait(self):
        events.append("wait")
        return orig_wait(self)

    dist.all_to_all_single, comm.Pending.wait = a2a, wait
    return lambda: (setattr(dist, "all_to_all_single", orig_a2a), setattr(comm.Pending, "wait", orig_wait))


def _note_linears(shared, events: list) -> None:
    """Note each of the shared expert's linears in forward ("fc1") and in backward ("fc1 back")."""
    for name in ("linear_fc1", "linear_fc2"):
        short = name.split("_")[1]

        def hook(module, args, out, short=short):
            events.append(short)
            out.register_hook(lambda g: events.append(f"{short} back"))

        getattr(shared, name).register_forward_hook(hook)


def overlap_case() -> dict:
    from megamoe.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(ep=2))
    x, g = batches(2)[groups.rank("dp")]
    out = {}
    for backend in ("local", "auto"):
        runs = {}
        for overlap in (False, True):
            layer = _layer(overlap, backend, groups)
            events: list = []
            _note_linears(layer.shared_experts, events)
            xi = x.clone().requires_grad_(True)
            undo = _spy(events)
            try:
                y = layer(xi)
                events.append("backward")
                loss = (y * g).sum()
                loss.backward()
            finally:
                undo()
            runs[overlap] = [y, loss, xi.grad] + [p.grad for p in layer.parameters()]
            out[f"{backend} events {overlap}"] = events
        pairs = list(zip(runs[False], runs[True]))
        out[f"{backend} bitwise"] = all(torch.equal(a, b) for a, b in pairs)
        out[f"{backend} rel"] = max(rel_err(b, a) for a, b in pairs)
    return out


def test_shared_expert_overlaps_the_all_to_alls(pool):
    for rank, r in enumerate(pool(2).run(overlap_case)):
        # forward: counts exchange; rows and weights issued, fc1, both waited; combine issued, fc2, waited.
        # backward: the combine's reverse issued, fc2, waited; the dispatch's two issued, fc1, waited
        assert r["local events True"] == [
            "all_to_all", "issue async", "issue async", "fc1", "wait", "wait", "issue async", "fc2", "wait",
            "backward", "issue async", "fc2 back", "wait", "issue async", "issue async", "fc1 back", "wait", "wait",
        ], r["local events True"]
        assert r["local events False"] == ["all_to_all"] * 4 + ["fc1", "fc2", "backward", "fc2 back", "fc1 back"] + \
            ["all_to_all"] * 3, r["local events False"]
        assert r["local bitwise"], f"rank {rank}: overlap changed a value on the local backend ({r['local rel']})"
        assert r["auto rel"] < 1e-6, r["auto rel"]
