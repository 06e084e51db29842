"""Choosing an expert placement from measured load (the rules are ``megamoe.core.placement``).

The load comes from a calibration pass (``calibrate``: tokens routed to each expert over
some batches) saved as JSON ``{"layers": {"3": [tokens per expert, ...], ...}}``;
``balanced_order`` assigns the heaviest experts first, each to the least loaded rank with a
free slot (LPT with equal capacities), which bounds the busiest rank's load near the mean.
With group-limited routing (``n_group``) it keeps every group in one block of slots
(``megamoe.core.placement``): whole groups go to ranks by the same rule when a rank holds whole
groups, and a group spread over several ranks balances its experts over them.
Calibration can run distributed: each rank routes its own batches and the counts are summed.
``replicated_placement`` also chooses the experts that redundant slots copy (``model.moe.redundant_experts``,
``megamoe.layers.mlp.replicas``), copy by copy where it most relieves the busiest rank, as DeepSeek's EPLB.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from megamoe.core.errors import ConfigError
from megamoe.model.moe_controls import routers
from megamoe.parallel import comm


def balanced_order(load: Sequence[float], ep: int, n_group: int = 1) -> list[int]:
    """Expert ids in slot order: heaviest first, each to the least-loaded rank with room
    (ties: the lower rank); within a rank, ascending ids. ``n_group`` > 1: groups kept whole."""
    n = len(load)
    if ep < 1 or n % ep:
        raise ConfigError(f"--ep={ep} must divide the {n} experts")
    if n_group > 1:
        return _group_order(load, ep, n_group)
    per, totals = n // ep, [0.0] * ep
    ranks: list[list[int]] = [[] for _ in range(ep)]
    for e in sorted(range(n), key=lambda i: (-float(load[i]), i)):
        r = min((r for r in range(ep) if len(ranks[r]) < per), key=lambda r: (totals[r], r))
        ranks[r].append(e)
        totals[r] += float(load[e])
    return [e for r in ranks for e in sorted(r)]


def _group_order(load: Sequence[float], ep: int, n_group: int) -> list[int]:
    n = len(load)
    size, per = n // n_group, n // ep
    if n % n_group == 0 and per % size == 0:  # a rank holds whole groups: place groups as units
        sums = [sum(float(x) for x in load[g * size:(g + 1) * size]) for g in range(n_group)]
        groups = balanced_order(sums, ep)
        return [g * size + i for g in groups for i in range(size)]
    if n % n_group == 0 and size % per == 0:  # a group spans size/per ranks: balance inside it
        out = []
        for g in range(n_group):
            inner = balanced_order(load[g * size:(g + 1) * size], size // per)
            out += [g * size + e for e in inner]
        return out
    raise ConfigError(f"--ep={ep}: {per} experts per rank and groups of {size} (n_group={n_group}) do not nest")


def rank_loads(load: Sequence[float], order: Sequence[int], ep: int, replicas: Sequence[int] = ()) -> list[float]:
    """The load each EP rank computes: the experts of its own slots (``order``) and of its extra
    slots (``replicas``, n/ep per rank), an expert's load split evenly over its copies."""
    copies = Counter(order) + Counter(replicas)
    own, extra = len(order) // ep, len(replicas) // ep
    held = [[*order[r * own:(r + 1) * own], *replicas[r * extra:(r + 1) * extra]] for r in range(ep)]
    return [sum(float(load[e]) / copies[e] for e in experts) for experts in held]


def imbalance(load: Sequence[float], order: Sequence[int], ep: int, replicas: Sequence[int] = ()) -> float:
    """Busiest EP rank's load / the mean rank load (1 = perfectly even)."""
    per_rank = rank_loads(load, order, ep, replicas)
    mean = sum(per_rank) / ep
    return max(per_rank) / mean if mean else 1.0


@torch.no_grad()
def calibrate(model, batches, group=None) -> dict[int, list[float]]:
    """Tokens routed to each expert (slot order of ``model``) per MoE layer, over ``batches``
    of input ids [b, s], in eval mode; ``group``: this rank's counts summed with those of the
    group's other ranks (each routing its own batches through the same model)."""
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
    for r in sorted(routers(model), key=lambda r: r.layer_number):  # every rank, every layer, same order
        total = counts.get(r.layer_number, torch.zeros(r.cfg.num_experts, dtype=torch.float64))
        counts[r.layer_number] = comm.all_reduce_tensor(torch.as_tensor(total, dtype=torch.float64), group)
    return {layer: c.tolist() for layer, c in sorted(counts.items())}


# ---- redundant experts -------------------------------------------------------------------------

def replicated_placement(load: Sequence[float], ep: int, n: int, n_group: int = 1,
                         ep_per_node: int | None = None) -> tuple[list[int], list[int]]:
    """(order, replicas): the experts in slot order and the ``n`` experts the extra slots copy
    (entry i on EP rank i // (n/ep)), both as ids of ``load``; of two greedy constructions (as
    DeepSeek's EPLB), the one with the lower busiest rank, an expert's load split evenly over its
    copies: ``_copies_on_top`` (the own slots as ``balanced_order``, then copies where they most
    relieve the busiest rank) and ``_copies_first`` (copies counted first, then every copy packed
    by its share). With groups (``n_group``) the own slots keep groups whole and a copy stays on
    its group's node (``ep_per_node`` consecutive EP ranks; default: all on one node), so a
    token's experts stay on as many nodes as without copies."""
    if ep < 2 or n % ep:
        raise ConfigError(f"--redundant={n} needs --ep > 1 dividing it (each EP rank holds n/ep replicas)")
    node = (ep_per_node or ep) if n_group > 1 else ep
    tries = [_copies_on_top(load, ep, n, n_group, node)]
    if node >= ep:  # counts copies over all ranks: no node to keep them on
        tries.append(_copies_first(load, ep, n, n_group))
    return min(tries, key=lambda t: imbalance(load, t[0], ep, t[1]))


def _copies_on_top(load, ep: int, n: int, n_group: int, node: int) -> tuple[list[int], list[int]]:
    """``balanced_order``, then one copy at a time the (expert, rank with a free extra slot and no
    copy of it, on the expert's node) that leaves the lowest busiest rank, then the lowest sum of
    squared rank loads; where no copy helps, a second slot for an expert of that rank alone."""
    own, extra = len(load) // ep, n // ep
    order = balanced_order(load, ep, n_group)
    holders = [[] for _ in load]  # ranks holding a copy of each expert, its own rank first
    for s, e in enumerate(order):
        holders[e].append(s // own)
    totals, extras = rank_loads(load, order, ep), [[] for _ in range(ep)]
    for _ in range(n):
        e, t = _best_copy(load, holders, totals, [len(x) < extra for x in extras], node)
        share, fewer = float(load[e]) / (len(holders[e]) + 1), float(load[e]) / len(holders[e])
        for r in holders[e]:
            totals[r] -= fewer - share
        totals[t] += share
        holders[e].append(t)
        extras[t].append(e)
    return order, [e for r in extras for e in sorted(r)]


def _copies_first(load, ep: int, n: int, n_group: int) -> tuple[list[int], list[int]]:
    """Copies counted first (each to the expert with the most load per copy, at most one per
    rank), the own slots by ``balanced_order`` of the shares, then the other copies, largest share
    first, each to the least-loaded rank with a free extra slot (and no copy of it, if any)."""
    own, extra = len(load) // ep, n // ep
    copies = [1] * len(load)
    for _ in range(n):
        e = max((i for i in range(len(load)) if copies[i] < ep), key=lambda i: (float(load[i]) / copies[i], -i))
        copies[e] += 1
    share = [float(load[e]) / copies[e] for e in range(len(load))]
    order = balanced_order(share, ep, n_group)
    totals, extras = rank_loads(share, order, ep), [[] for _ in range(ep)]
    held = [{s // own} for s in sorted(range(len(order)), key=lambda s: order[s])]  # by expert
    for e in sorted((e for e in range(len(load)) for _ in range(copies[e] - 1)), key=lambda e: (-share[e], e)):
        free = [r for r in range(ep) if len(extras[r]) < extra]
        r = min([r for r in free if r not in held[e]] or free, key=lambda r: (totals[r], r))
        extras[r].append(e)
        held[e].add(r)
        totals[r] += share[e]
    return order, [e for r in extras for e in sorted(r)]


def _best_copy(load, holders, totals, free: list[bool], node: int) -> tuple[int, int]:
    """The (expert, rank) whose new copy leaves the lowest (busiest rank, sum of squares)."""
    ranked = sorted(range(len(totals)), key=lambda r: -totals[r])
    best = None
    for e, held in enumerate(holders):
        share = float(load[e]) / (len(held) + 1)
        less = float(load[e]) / len(held) - share  # what each holder gives up
        for t in range(len(totals)):
            if not free[t] or t // node != held[0] // node:
                continue
            if held == [t]:  # a second slot for an expert of t alone changes no load: where nothing helps
                best = min(best or (totals[ranked[0]], 0.0, e, t), (totals[ranked[0]], 0.0, e, t))
                continue
            if t in held:
                continue
            rest = next((totals[r] for r in ranked if r != t and r not in held), 0.0)
            peak = max(rest, totals[t] + share, *(totals[r] - less for r in held))
            squares = sum(less * less - 2 * totals[r] * less for r in held) + share * share + 2 * totals[t] * share
            if best is None or (peak, squares, e, t) < best:
                best = (peak, squares, e, t)
    if best is None:
        raise ConfigError("--redundant: no expert has a rank left for another copy (fewer replicas, or more ranks)")
    return best[2], best[3]
