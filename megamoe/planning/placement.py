"""Choosing an expert placement from measured load (the rules are ``megamoe.core.placement``).

The load comes from a calibration pass (``calibrate``: tokens routed to each expert over
some batches) saved as JSON ``{"layers": {"3": [tokens per expert, ...], ...}}``;
``balanced_order`` assigns the heaviest experts first, each to the least loaded rank with a
free slot (LPT with equal capacities), which bounds the busiest rank's load near the mean.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megamoe.core.errors import ConfigError
from megamoe.model.moe_controls import routers


def balanced_order(load: Sequence[float], ep: int) -> list[int]:
    """Expert ids in slot order: heaviest first, each to the least-loaded rank with room
    (ties: the lower rank); within a rank, ascending ids."""
    n = len(load)
    if ep < 1 or n % ep:
        raise ConfigError(f"--ep={ep} must divide the {n} experts")
    per, totals = n // ep, [0.0] * ep
    ranks: list[list[int]] = [[] for _ in range(ep)]
    for e in sorted(range(n), key=lambda i: (-float(load[i]), i)):
        r = min((r for r in range(ep) if len(ranks[r]) < per), key=lambda r: (totals[r], r))
        ranks[r].append(e)
        totals[r] += float(load[e])
    return [e for r in ranks for e in sorted(r)]


def rank_loads(load: Sequence[float], order: Sequence[int], ep: int) -> list[float]:
    per = len(order) // ep
    return [sum(float(load[e]) for e in order[r * per:(r + 1) * per]) for r in range(ep)]


def imbalance(load: Sequence[float], order: Sequence[int], ep: int) -> float:
    """Busiest EP rank's load / the mean rank load (1 = perfectly even)."""
    per_rank = rank_loads(load, order, ep)
    mean = sum(per_rank) / ep
    return max(per_rank) / mean if mean else 1.0


@torch.no_grad()
def calibrate(model, batches) -> dict[int, list[float]]:
    """Tokens routed to each expert (slot order of ``model``) per MoE layer, over ``batches``
    of input ids [b, s], in eval mode."""
    counts: dict[int, torch.Tensor] = {}

    def hook(router, inputs, out):
        n = router.cfg.num_experts
        c = torch.bincount(out.idx.reshape(-1).cpu(), minlength=n).double()
        counts[router.layer_number] = counts.get(router.layer_number, 0) + c

    handles = [r.register_forward_hook(hook) for r in routers(model)]
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {layer: c.tolist() for layer, c in sorted(counts.items())}
