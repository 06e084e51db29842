"""Token dispatch: send each (token, expert) pair to the rank holding the expert, and back.

Every rank routes its own tokens (under TP, a sequence shard: see ``megamoe.layers.mlp.moe``).
The expert grid is megatron-core's: ``ep`` ranks hold different experts, ``etp`` ranks hold
slices of the same experts' f dim, ``tp_ep`` is the two together.

``alltoall`` (the default), like megatron-core's MoEAlltoAllTokenDispatcher::

    pairs sorted by expert -> all-to-all over ep (variable splits; counts exchanged first)
    -> all-gather over etp -> regroup rows by local expert -> experts (partial over etp)
    -> reduce-scatter over etp -> all-to-all back -> weighted sum per token

``allgather``: every rank of ``tp_ep`` gathers all the group's tokens, computes the pairs
routed to its own experts and the partial outputs are reduce-scattered back. Simpler, and
better when most tokens go to most ranks anyway.

With a single-rank expert grid both reduce to the local path, which reads tokens in place.
The routing weights travel with the rows and are applied inside the expert kernel. Row
counts may differ between ranks (variable splits); collectives with equal sizes use plain
all-gather / reduce-scatter.

Host synchronisations: one per layer and forward, whatever the grid. The per-expert counts
stay on the device through the count exchange (all-to-all over ep, all-gather over etp; the
allgather dispatcher gathers token and expert counts together) and are read on the host once
(``ExchangePlan``): the collectives' split sizes and the expert kernels' row counts are python
ints, and the backward reuses them. ``megamoe.diagnostics.host_sync`` counts them.

Shapes: x [T, h]; weights [T, k] fp32; idx [T, k] global expert ids; keep [T, k] bool|None.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups, group_rank, group_size


def sort_pairs(key: torch.Tensor, num_bins: int, all_valid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (token, slot) pairs ordered by ``key`` (bin), without reading anything on the host:
    (order [T*k], counts per bin [num_bins] on the device). Keys outside [0, num_bins) sort last;
    the valid pairs are ``order[:counts.sum()]``. ``all_valid``: the caller knows every key is a
    bin (dropless): no masking."""
    flat = key.reshape(-1)
    if all_valid:
        return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_bins)
    sort_key = torch.where((flat >= 0) & (flat < num_bins), flat, num_bins)
    return torch.argsort(sort_key, stable=True), torch.bincount(sort_key, minlength=num_bins + 1)[:num_bins]


def group_pairs(key: torch.Tensor, num_bins: int, all_valid: bool = False) -> tuple[torch.Tensor, list[int]]:
    """``sort_pairs`` with its counts read on the host (one synchronisation) and the dropped
    pairs cut off. key: [T, k] long -> (order [S] indices into the flattened pairs, counts per bin).
    """
    order, counts = sort_pairs(key, num_bins, all_valid)
    counts = counts.tolist()
    return order if all_valid else order[:sum(counts)], counts


def gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Rank r's [sizes[r], ...] -> [sum(sizes), ...] in rank order on every rank; the backward
    sums every rank's gradient for this rank's rows."""
    n = len(sizes)
    if n == 1:
        return x
    if len(set(sizes)) == 1:
        return comm.gather_reduce_scatter(x, 0, group)
    repeated = x.unsqueeze(0).expand(n, *x.shape).reshape(n * x.size(0), *x.shape[1:])
    return comm.all_to_all(repeated, list(sizes), [x.size(0)] * n, group)


def reduce_scatter_rows(y: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """[sum(sizes), ...] partial sums on every rank -> this rank's [sizes[me], ...] summed."""
    n = len(sizes)
    if n == 1:
        return y
    if len(set(sizes)) == 1:
        return comm.reduce_scatter_to(y, 0, group)
    mine = sizes[group_rank(group)]
    got = comm.all_to_all(y, [mine] * n, list(sizes), group)
    return got.view(n, mine, *y.shape[1:]).sum(0)


def _phases(during) -> tuple:
    """``during`` as (work while the dispatch all-to-all is in flight, work while the combine's
    is): None, one callable (the dispatch's), or a pair."""
    if during is None or callable(during):
        return during, None
    return tuple(during)


def _run(during) -> None:
    """All of ``during`` now (a path without an all-to-all to overlap), in order."""
    for work in _phases(during):
        if work is not None:
            work()


def _dropped_to(idx: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return idx if keep is None else idx.masked_fill(~keep, -1)


def dispatch_local(x, weights, idx, keep, experts, num_experts: int, outside_graph=None) -> torch.Tensor:
    """Single-rank expert grid: experts read x in place and accumulate per token. Inside a
    compiled graph (python expert counts cannot be traced) the experts' one opaque op where
    they have one, else this dispatch runs outside the graph (``outside_graph``, the
    dispatcher's once ``compile_ready`` made it: a graph break; without it dynamo traces the
    dispatch, with its own breaks)."""
    if torch.compiler.is_compiling():
        local = getattr(experts, "local_dispatch", None)
        y = local(x, weights, idx) if keep is None and local is not None else None
        if y is not None:
            return y
        return (outside_graph or _dispatch_pairs)(x, weights, idx, keep, experts, num_experts)
    return _dispatch_pairs(x, weights, idx, keep, experts, num_experts)


def local_pairs(weights, idx, keep, num_experts: int):
    """The single-rank grid's (token, expert) pairs grouped by expert: (token of each pair [S],
    rows per expert [E] ints, each pair's routing weight [S]); ``keep`` [T, k] | None."""
    order, counts = group_pairs(_dropped_to(idx, keep), num_experts, all_valid=keep is None)
    return order // idx.size(1), counts, weights.reshape(-1).index_select(0, order)


def _dispatch_pairs(x, weights, idx, keep, experts, num_experts: int) -> torch.Tensor:
    token, counts, probs = local_pairs(weights, idx, keep, num_experts)
    return experts(x, token, counts, probs, x.size(0))


def compile_ready(model: torch.nn.Module) -> None:
    """Before compiling ``model``: its dispatchers get the dispatch that runs outside a compiled
    graph. Per model, and not at import: ``torch.compiler.disable`` imports dynamo and inductor
    (~150 MiB of RSS, 0.3 s) into the process, compiling or not."""
    outside = torch.compiler.disable(_dispatch_pairs)
    for m in model.modules():
        d = getattr(m, "dispatch", None)
        if isinstance(d, (AllToAllDispatcher, AllGatherDispatcher)):
            d.outside_graph = outside
            ranks = d.ep_size * d.etp_size if isinstance(d, AllToAllDispatcher) else d.size
            if ranks > 1:
                m.dispatch = OutsideGraph(d)
        elif getattr(d, "static_shapes", False):  # its exchange has no host-read sizes: traced
            d.outside_graph, d.outside_experts = outside, torch.compiler.disable(d.expert_rows_eager)


class OutsideGraph:
    """A dispatcher over several ranks, run outside a compiled graph (the graph breaks around the
    MoE exchange): its exchange reads the counts on the host and the expert kernels it calls
    have no fp32 fake form to trace. Attributes are the dispatcher's."""

    def __init__(self, dispatcher):
        self.dispatcher, self.call = dispatcher, torch.compiler.disable(dispatcher.__call__)

    def __call__(self, x, weights, idx, keep, experts, during=None) -> torch.Tensor:
        return self.call(x, weights, idx, keep, experts, during)

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)


def _exchange(tensors: list[torch.Tensor], out_splits: list[int], in_splits: list[int], group, during=None):
    """The all-to-all of each tensor; with ``during``: all issued, ``during()``, all waited on."""
    if during is None:
        return [comm.all_to_all(t, out_splits, in_splits, group) for t in tensors]
    started = [comm.all_to_all_start(t, out_splits, in_splits, group) for t in tensors]
    during()
    return [comm.all_to_all_wait(out, pending) for out, pending in started]


@dataclass
class ExchangePlan:
    """One layer's token exchange, decided once per forward (host lists are what the collectives
    and expert kernels take; the backward reuses them, so it reads nothing on the host)."""

    order: torch.Tensor  # [S] this rank's kept (token, slot) pairs, sorted by expert
    in_splits: list[int]  # rows sent to each ep rank
    out_splits: list[int]  # rows received from each ep rank
    etp_sizes: list[int]  # rows each etp rank received (all its ep sources)
    expert_counts: list[int]  # rows per local expert, over every source and etp rank
    perm: torch.Tensor  # received rows (etp rank, source, expert) -> expert-major


class AllToAllDispatcher:
    outside_graph = None  # the dispatch outside a compiled graph (compile_ready), on one rank

    def __init__(self, num_experts: int, groups: ParallelGroups):
        self.num_experts, self.ep, self.etp = num_experts, groups.ep, groups.etp
        self.ep_size, self.etp_size = group_size(groups.ep), group_size(groups.etp)
        self.num_local = num_experts // self.ep_size
        self.etp_rank = group_rank(groups.etp)

    def __call__(self, x, weights, idx, keep, experts, during=None) -> torch.Tensor:
        """``during``: work run (once) while the all-to-alls are in flight (the shared expert):
        one callable for the dispatch's, or a pair (the dispatch's, the combine's). Each
        overlapped all-to-all is issued, the work runs, then it is waited on; backward mirrors
        it (``comm.all_to_all_start``), so the work's backward overlaps the reverse all-to-all."""
        if self.ep_size * self.etp_size == 1:
            _run(during)
            return dispatch_local(x, weights, idx, keep, experts, self.num_experts, self.outside_graph)
        first, second = _phases(during)
        plan = self.plan(idx, keep)
        token = plan.order // idx.size(1)
        send_x = x.index_select(0, token)
        send_p = weights.reshape(-1).index_select(0, plan.order)
        rx, rp = _exchange([send_x, send_p], plan.out_splits, plan.in_splits, self.ep, first)
        if self.etp_size > 1:  # every etp rank computes its f-slice for all the etp group's rows
            rx, rp = gather_rows(rx, plan.etp_sizes, self.etp), gather_rows(rp, plan.etp_sizes, self.etp)
        y = experts(rx, plan.perm, plan.expert_counts, rp.index_select(0, plan.perm), rx.size(0))
        y = reduce_scatter_rows(y, plan.etp_sizes, self.etp)
        back, = _exchange([y], plan.in_splits, plan.out_splits, self.ep, second)
        return x.new_zeros(x.shape).index_add(0, token, back)

    def plan(self, idx: torch.Tensor, keep: torch.Tensor | None) -> ExchangePlan:
        """Sort this rank's pairs by expert, exchange the per-expert counts over ep (and etp) on
        the device, then read them on the host once: the layer's only host synchronisation."""
        ep, n_local, n = self.ep_size, self.num_local, self.num_experts
        order, counts = sort_pairs(_dropped_to(idx, keep), n, all_valid=keep is None)
        recv = comm.all_to_all(counts, [n_local] * ep, [n_local] * ep, self.ep)  # [ep * n_local] (source, expert)
        if self.etp_size > 1:
            recv = comm.all_gather_tensor(recv, 0, self.etp)  # [etp * ep * n_local] (etp rank, source, expert)
        host = torch.cat([counts, recv]).tolist()
        sent, got = host[:n], host[n:]
        per_source = [sum(got[i:i + n_local]) for i in range(0, len(got), n_local)]
        # received rows are ordered (etp rank, source, expert); the experts want them expert-major
        got_dev = recv.reshape(-1)
        row_expert = torch.arange(n_local, device=idx.device).repeat(got_dev.numel() // n_local)
        row_expert = torch.repeat_interleave(row_expert, got_dev, output_size=sum(got))
        return ExchangePlan(
            order=order if keep is None else order[:sum(sent)],
            in_splits=[sum(sent[r * n_local:(r + 1) * n_local]) for r in range(ep)],
            out_splits=per_source[:ep] if self.etp_size == 1 else per_source[self.etp_rank * ep:(self.etp_rank + 1) * ep],
            etp_sizes=[sum(per_source[q * ep:(q + 1) * ep]) for q in range(self.etp_size)],
            expert_counts=[sum(got[e::n_local]) for e in range(n_local)],
            perm=torch.argsort(row_expert, stable=True))


class AllGatherDispatcher:
    outside_graph = None  # as AllToAllDispatcher's

    def __init__(self, num_experts: int, groups: ParallelGroups):
        self.num_experts, self.group = num_experts, groups.tp_ep
        self.size = group_size(groups.tp_ep)
        self.num_local = num_experts // groups.size("ep")
        self.first = groups.rank("ep") * self.num_local

    def __call__(self, x, weights, idx, keep, experts, during=None) -> torch.Tensor:
        _run(during)  # (not overlapped: the gathers are one collective each way)
        if self.size == 1:
            return dispatch_local(x, weights, idx, keep, experts, self.num_experts, self.outside_graph)
        sizes, counts = self.exchange_counts(idx, keep)
        x_all = gather_rows(x, sizes, self.group)
        w_all = gather_rows(weights, sizes, self.group)
        idx_all = gather_rows(_dropped_to(idx, keep), sizes, self.group)
        # dropped pairs (-1) and other ranks' experts sort last, after the sum(counts) kept ones
        order, _ = sort_pairs(idx_all - self.first, self.num_local)
        order = order[:sum(counts)]
        token = order // idx.size(1)
        y = experts(x_all, token, counts, w_all.reshape(-1).index_select(0, order), x_all.size(0))
        return reduce_scatter_rows(y, sizes, self.group)

    def exchange_counts(self, idx: torch.Tensor, keep: torch.Tensor | None) -> tuple[list[int], list[int]]:
        """(tokens of each rank of the group, rows per local expert over the group's tokens): every
        rank's token count and per-expert counts gathered on the device and read on the host once."""
        _, mine = sort_pairs(_dropped_to(idx, keep), self.num_experts)
        row = torch.cat([mine.new_tensor([idx.size(0)]), mine]).view(1, -1)  # [1, 1 + E]
        table = comm.all_gather_tensor(row, 0, self.group).tolist()  # [group, 1 + E]
        local = slice(1 + self.first, 1 + self.first + self.num_local)
        return [r[0] for r in table], [sum(c) for c in zip(*(r[local] for r in table))]


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
