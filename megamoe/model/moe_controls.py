"""What a trainer calls on a model's MoE layers: metrics, the expert-bias update, loss scaling.

    metrics = moe_metrics(model, groups)      # per layer, since the last call (a collective)
    update_expert_bias(model, groups)         # after each optimizer step (a collective)
    with recording(model, False): ...         # forwards outside training not counted
    set_aux_loss_scale(model, 1 / micro_batches)

Collectives run over the pipeline stage's ranks (``tp`` and ``dp_cp``); call them on every
rank of the stage. Routers are found by type, so any model holding MoE layers works.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from megamoe.layers.mlp.router import TopKRouter
from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups


def routers(model: nn.Module) -> list[TopKRouter]:
    """The model's routers in layer order."""
    return sorted((m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda r: r.layer_number)


@contextlib.contextmanager
def recording(model: nn.Module | list[TopKRouter], enabled: bool):
    """Whether the routers' forwards outside training add to what ``moe_metrics`` reports
    (default: they do; training forwards always do). Generation turns it off for its decode
    steps. ``model``: a model, or its ``routers(model)`` (found once, not at every step)."""
    found = routers(model) if isinstance(model, nn.Module) else model
    before = [r.record_stats for r in found]
    for r in found:
        r.record_stats = enabled
    try:
        yield
    finally:
        for r, was in zip(found, before):
            r.record_stats = was


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Scale of the balancing-loss gradients: use the factor applied to the main loss
    (e.g. 1 / number of micro-batches when their losses are averaged)."""
    for r in routers(model):
        r.aux_loss_scale = float(scale)


def update_expert_bias(model: nn.Module, groups: ParallelGroups | None = None) -> dict[int, torch.Tensor]:
    """Aux-loss-free balancing step for every router with an expert bias: bias += rate *
    sign(mean load - load), from the load accumulated over the step's micro-batches and summed
    over all ranks of the stage (so every data-parallel replica makes the same update).
    Returns the load used per layer number."""
    out = {}
    for r in routers(model):
        load = r.update_bias(groups)
        if load is not None:
            out[r.layer_number] = load
    return out


def _layer_metrics(r: TopKRouter, groups: ParallelGroups) -> dict:
    stats = r.stats
    # counts and sums over every token of the stage: TP/CP shards and data-parallel replicas
    summed = torch.cat([stats["tokens"], torch.stack([stats["entropy_sum"], stats["num_tokens"], stats["dropped"]])])
    for g in (groups.tp, groups.dp_cp):
        summed = comm.all_reduce_tensor(summed, g)
    tokens = summed[:-3]
    entropy_sum, num_tokens, dropped = summed[-3:].tolist()
    out = {"tokens_per_expert": tokens.tolist(),
           "imbalance": (tokens.max() / tokens.mean().clamp_min(1e-20)).item(),
           "router_entropy": entropy_sum / max(num_tokens, 1.0),
           "dropped_tokens": dropped,
           "dropped_fraction": dropped / max(num_tokens * r.cfg.top_k, 1.0)}
    forwards = stats["forwards"].item()
    dp = groups.size("dp")
    for name in ("aux_loss", "seq_aux_loss", "z_loss"):
        if name in stats:  # shares summed over the micro-batch's shards, averaged over replicas
            value = stats[name].clone()
            for g in (groups.tp, groups.cp, groups.dp):
                value = comm.all_reduce_tensor(value, g)
            out[name] = value.item() / forwards / dp
    return out


def moe_metrics(model: nn.Module, groups: ParallelGroups | None = None, reset: bool = True) -> dict[int, dict]:
    """Per MoE layer (by layer number), over the forwards since the last call:
    ``tokens_per_expert`` (list, all ranks of the stage), ``imbalance`` (max / mean),
    ``router_entropy`` (mean per token, nats), ``dropped_tokens`` / ``dropped_fraction``
    (capacity), and the unweighted ``aux_loss`` / ``seq_aux_loss`` / ``z_loss`` per micro-batch
    when enabled. Layers that saw no forward are left out."""
    out = {}
    for r in routers(model):
        if not r.stats:
            continue
        out[r.layer_number] = _layer_metrics(r, groups or r.groups)
        if reset:
            r.stats = {}
    return out
