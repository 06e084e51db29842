"""Static-shape token dispatch over expert parallelism: no host synchronisation at all.

``moe.dispatcher: static`` (with ``moe.capacity_factor``), Megatron-Core's all-to-all with
``moe_pad_expert_input_to_capacity``. Every rank sends every expert exactly ``C`` rows
(``C = ceil(capacity_factor * T * k / E)``, the router's capacity, so the kept pairs are the
``alltoall`` dispatcher's with the same capacity): the pairs an expert keeps fill its first
rows, the rest are zero rows with weight 0. The split sizes and the experts' row counts are
then python ints known from the shapes alone: nothing is read on the host, no count exchange
runs, and a compiled graph can hold the whole exchange (CUDA graphs too). The price is the
padding: the experts run ``E * C`` rows per rank where ``alltoall`` runs the kept ones, and a
pair past its expert's capacity is dropped. Layouts (one rank, ``ep`` ranks; ``etp`` = 1)::

    pairs [T*k] -> slot = expert * C + position in expert      (positions < C: kept)
    send  [E*C, h]    rows of expert e at [e*C, (e+1)*C): contiguous per destination rank
    recv  [ep, n_local, C, h]  (source, local expert, slot) -> expert-major [n_local, ep*C, h]
    back  [E*C, h]    the same slots, weighted outputs -> summed per token

``capacity_factor`` large enough for the busiest expert (``E / k`` makes ``C = T``) drops nothing:
the static mode then equals the dropless dispatch, at the cost of the padding.
"""
from __future__ import annotations

import math

import torch

from megamoe.core.errors import ConfigError
from megamoe.layers.mlp.dispatch import DISPATCHERS, _dropped_to, _exchange, _phases, _run, dispatch_local
from megamoe.layers.mlp.router import positions_in_bins
from megamoe.parallel.groups import ParallelGroups, group_size


class StaticAllToAllDispatcher:
    outside_graph = None  # the single-rank dispatch outside a compiled graph (compile_ready)
    static_shapes = True  # compile_ready leaves the exchange inside the graph
    outside_experts = None  # expert_rows_eager outside a compiled graph (compile_ready)

    def __init__(self, num_experts: int, groups: ParallelGroups, capacity_factor: float, top_k: int,
                 routed_experts: int | None = None):
        """``num_experts``: the expert slots (with redundant copies, E + N); ``routed_experts``:
        the router's E (default: the slots), whose capacity bounds every slot's rows: a copy
        takes a part of its expert's kept pairs."""
        self.num_experts, self.ep = num_experts, groups.ep
        self.routed_experts = routed_experts or num_experts
        self.ep_size = group_size(groups.ep)
        self.num_local = num_experts // self.ep_size
        self.capacity_factor, self.top_k = capacity_factor, top_k
        if group_size(groups.etp) > 1:
            raise ConfigError("moe.dispatcher: static runs with parallel.etp=1 (expert tensor parallelism "
                              "gathers variable row counts); use alltoall")

    def capacity(self, tokens: int) -> int:
        """Rows per expert per rank: the router's capacity for ``tokens`` tokens."""
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.routed_experts))

    def __call__(self, x, weights, idx, keep, experts, during=None) -> torch.Tensor:
        """x [T, h], weights/idx/keep [T, k] -> [T, h]; ``during`` runs while the rows travel."""
        if self.ep_size == 1:
            _run(during)
            return dispatch_local(x, weights, idx, keep, experts, self.num_experts, self.outside_graph)
        cap, n, ep = self.capacity(x.size(0)), self.num_experts, self.ep_size
        slot = self.slots(_dropped_to(idx, keep), cap)  # [T*k], n*cap for a dropped pair
        token = torch.arange(idx.numel(), device=idx.device) // idx.size(1)
        # one scratch row (index n*cap) takes the dropped pairs and is cut off
        send_x = x.new_zeros(n * cap + 1, x.size(1)).index_copy(0, slot, x.index_select(0, token))[:-1]
        send_p = weights.new_zeros(n * cap + 1).index_copy(0, slot, weights.reshape(-1))[:-1]
        splits = [self.num_local * cap] * ep
        first, second = _phases(during)
        if torch.compiler.is_compiling():  # a graph holds no pending work: the compiler orders it
            _run(during)
            first = second = None
        rx, rp = _exchange([send_x, send_p], splits, splits, self.ep, first)
        y = self.expert_rows(experts, rx, rp, cap)
        back, = _exchange([y], splits, splits, self.ep, second)
        back = torch.cat([back, back.new_zeros(1, back.size(1))])  # the scratch row: dropped pairs add 0
        return x.new_zeros(x.shape).index_add(0, token, back.index_select(0, slot))

    def expert_rows(self, experts, rx: torch.Tensor, rp: torch.Tensor, cap: int) -> torch.Tensor:
        """The received rows' weighted expert outputs, in received order. In a compiled graph the
        experts' one opaque op (their counts are python ints a graph cannot hold) where they have
        it, else the kernels run outside the graph (``outside_experts``, set by compile_ready)."""
        if torch.compiler.is_compiling():
            rows = self.num_local * cap
            row_expert = torch.arange(rows, device=rx.device).div(cap, rounding_mode="floor").repeat(self.ep_size)
            y = experts.local_dispatch(rx, rp.unsqueeze(1), row_expert.unsqueeze(1), local_ids=True)
            if y is not None:
                return y
            if self.outside_experts is not None:
                return self.outside_experts(experts, rx, rp, cap)
        return self.expert_rows_eager(experts, rx, rp, cap)

    def expert_rows_eager(self, experts, rx: torch.Tensor, rp: torch.Tensor, cap: int) -> torch.Tensor:
        perm = self.expert_major(cap, rx.device)
        return experts(rx, perm, [self.ep_size * cap] * self.num_local, rp.index_select(0, perm), rx.size(0))

    def slots(self, key: torch.Tensor, cap: int) -> torch.Tensor:
        """Each pair's row in the send buffer: expert * cap + its position among the expert's
        pairs (token order), or ``num_experts * cap`` for a dropped pair (key -1) or one past the
        capacity. All on the device. key [T, k] -> [T*k]."""
        n = self.num_experts
        flat = key.reshape(-1)
        valid = flat >= 0
        expert = torch.where(valid, flat, n)
        position = positions_in_bins(expert, torch.argsort(expert, stable=True), n + 1)
        fits = valid & (position < cap)
        return torch.where(fits, expert * cap + position, n * cap)

    def expert_major(self, cap: int, device) -> torch.Tensor:
        """Received rows (source, local expert, slot) -> expert-major order: [ep*n_local*cap]."""
        rows = torch.arange(self.ep_size * self.num_local * cap, device=device)
        return rows.view(self.ep_size, self.num_local, cap).transpose(0, 1).reshape(-1)


def build_dispatcher(cfg, groups: ParallelGroups, slots: int | None = None):
    """The dispatcher ``cfg`` (a MoEConfig) names, over ``groups``' expert grid and ``slots``
    expert slots (default ``cfg.num_experts``; more with redundant copies)."""
    slots = slots or cfg.num_experts
    if cfg.dispatcher == "static":
        return StaticAllToAllDispatcher(slots, groups, cfg.capacity_factor, cfg.top_k, cfg.num_experts)
    return DISPATCHERS[cfg.dispatcher](slots, groups)
