"""Redundant hot experts (``model.moe.redundant_experts=N``, as DeepSeek's EPLB): N extra expert
slots, N/ep on each EP rank, each holding a copy of an expert another rank owns, so that the tokens
of a hot expert are shared by several ranks.

Slots (``megamoe.core.placement.replica_slots``): rank r holds S/ep = E/ep + N/ep slots, global ids
r*S/ep ..: first its E/ep own experts (the role's parameters, as without replicas), then its N/ep
replicas. The dispatcher works on the S slots as it does on E experts.

Weights: a replica is not a parameter. Every forward each rank sends the rows of its own experts
that other ranks replicate, in one all-to-all over ep whose split sizes are fixed when the layer is
built (no host synchronisation); its backward sums each replica's gradient into its owner's row.
So the copies are equal by construction, optimizer, checkpoints and converters see each expert
once, and the layer computes what the unreplicated layer computes. What it costs: N/ep experts'
weights sent per forward (and their gradients per backward) and held while the step runs.

Tokens: the pairs (token, expert) a rank routes to an expert with c copies go to the copies in
token order, the j-th pair to copy j mod c: reproducible, and even on every rank.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megamoe.core.placement import replica_slots
from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups


class ExpertReplicas:
    """One MoE layer's replica slots over ``ep`` ranks (this one ``ep_rank``); ``replicas``: the
    router indices of the experts the N extra slots copy (entry i on EP rank i // (N/ep))."""

    def __init__(self, num_experts: int, replicas: Sequence[int], ep: int, ep_rank: int = 0, group=None):
        n = len(replicas)
        if num_experts % ep or n % ep:
            raise ValueError(f"{num_experts} experts and {n} replicas do not split over ep={ep}")
        self.num_experts, self.num_slots, self.group = num_experts, num_experts + n, group
        self.slots = replica_slots(num_experts, replicas, ep)
        own, extra = num_experts // ep, n // ep
        # the exchange: this rank sends its rows that others replicate, by destination then replica
        # index; it receives its own replicas by source rank then replica index
        sends = [(i // extra, e % own) for i, e in enumerate(replicas) if e // own == ep_rank]
        mine = sorted((e // own, i) for i, e in enumerate(replicas) if i // extra == ep_rank)
        self.send_rows = [row for _, row in sends]
        self.in_splits = [sum(1 for d, _ in sends if d == q) for q in range(ep)]
        self.out_splits = [sum(1 for s, _ in mine if s == q) for q in range(ep)]
        self.arrival = [mine.index(m) for m in sorted(mine, key=lambda m: m[1])]  # replica j's received row
        self._tables: dict = {}

    @classmethod
    def of(cls, num_experts: int, replicas: Sequence[int] | None, groups: ParallelGroups) -> "ExpertReplicas | None":
        if not replicas:
            return None
        return cls(num_experts, replicas, groups.size("ep"), groups.rank("ep"), groups.ep)

    def route(self, idx: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """idx [T, k] router indices -> [T, k] slot ids; the kept pairs of an expert with c copies
        go to copy j mod c, j counting that expert's kept pairs in (token, k) order."""
        table, copies, _, _ = self._tensors(idx.device)
        flat = idx.reshape(-1)
        key = flat if keep is None else torch.where(keep.reshape(-1), flat, self.num_experts)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.num_experts + 1)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=idx.device)
        copy = (position - starts[key]) % copies[flat]
        return table[flat, copy].view_as(idx)

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(slots of each expert [E, max copies] padded with its first, copies [E], rows sent,
        arrival order) on ``device``, made once."""
        if device not in self._tables:
            width = max(len(s) for s in self.slots)
            self._tables[device] = tuple(torch.tensor(t, dtype=torch.long, device=device) for t in (
                [s + s[:1] * (width - len(s)) for s in self.slots], [len(s) for s in self.slots], self.send_rows,
                self.arrival))
        return self._tables[device]

    def fetch(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's expert weights [E/ep, ...] -> its replicas' [N/ep, ...], fetched from their
        owners in one all-to-all over ep (backward: their gradients summed into the owners' rows)."""
        _, _, rows, arrival = self._tensors(w1.device)
        send = torch.cat([w1.index_select(0, rows).flatten(1), w2.index_select(0, rows).flatten(1)], 1)
        got = comm.all_to_all(send, self.out_splits, self.in_splits, self.group).index_select(0, arrival)
        g1, g2 = got.split([w1[0].numel(), w2[0].numel()], 1)
        return g1.reshape(-1, *w1.shape[1:]), g2.reshape(-1, *w2.shape[1:])

    def bind(self, experts):
        """The routed-experts role over this rank's slots, ``(x, idx, counts [S/ep], probs,
        out_rows)`` as the role's forward: its own experts through the role itself, the replica
        slots through its kernel on the fetched weights (no copy of the own experts' weights)."""
        extra = len(self.arrival)  # replica slots on this rank

        def run(x, idx, counts, probs, out_rows):
            own_counts, replica_counts = counts[:len(counts) - extra], counts[len(counts) - extra:]
            split = sum(own_counts)
            y = experts(x, idx[:split], own_counts, None if probs is None else probs[:split], out_rows)
            w1, w2 = self.fetch(experts.gate_up_weight, experts.down_weight)
            return y + experts.compute(x, idx[split:], replica_counts, None if probs is None else probs[split:],
                                       w1, w2, out_rows)
        return run
