"""Gradient synchronisation and the global gradient norm over the whole grid.

Order (``sync_grads``, after backward; ``megamoe.training.grad_overlap`` issues the same
data-parallel sums from backward hooks instead): TP-partial grads summed over TP (``finalize_grads``), the embedding's
grads summed over the first and last pipeline stage where the last holds a copy (tied to the
output layer, or read by the multi-token-prediction depths), then dense grads summed over the
data(-context)-parallel group and expert grads over the expert-data-parallel group, in the
buckets of ``plan_buckets``. The
loss is normalised by the global token count, so sums (not averages) make every layout
equal the single-process run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.record import is_expert_param  # noqa: F401  (also imported from here)
from megamoe.parallel.sharding import sharding
from megamoe.model.weights import finalize_grads
from megamoe.training.config import GRAD_BUCKET_ELEMENTS

BUCKET_ELEMENTS = GRAD_BUCKET_ELEMENTS  # elements per gradient bucket (train.grad_bucket_size)


@dataclass
class GradBucket:
    """Gradients reduced together over one data-parallel group: one flat tensor per dtype."""

    params: list[torch.Tensor]  # in the order backward finishes them (the model's order reversed)
    group: object  # dp_cp for dense parameters, edp for routed experts
    # holds a parameter that is first summed over another group after backward (the embedding
    # shared by the first and last stage, a parameter of several chunks): launched after backward
    deferred: bool = False


def plan_buckets(parts: list[nn.Module], groups: ParallelGroups, limit: int = BUCKET_ELEMENTS) -> list[GradBucket]:
    """The data-parallel gradient buckets of ``parts``' trainable parameters, in launch order:
    parameters of ``forward_order`` walked backwards (the order backward finishes them), dense and
    expert parameters in separate buckets, each closed once it holds ``limit`` elements. The
    reduction after backward (``sync_grads``) and the one from backward hooks
    (``megamoe.training.grad_overlap``) sum the same flat tensors, so they agree bitwise."""
    counts: dict[int, int] = {}
    for part in parts:
        for p in part.parameters():
            counts[id(p)] = counts.get(id(p), 0) + 1
    late = {id(p) for p in tied_params(parts, groups)} | {i for i, n in counts.items() if n > 1}
    out: list[GradBucket] = []
    open_: dict[bool, tuple[GradBucket, list[int]]] = {}  # expert? -> (bucket, [elements])
    for p in reversed(forward_order(parts)):
        expert = is_expert_param(p)
        if expert not in open_:
            open_[expert] = (GradBucket([], groups.edp if expert else groups.dp_cp), [0])
        bucket, size = open_[expert]
        bucket.params.append(p)
        bucket.deferred |= id(p) in late
        size[0] += p.numel()
        if size[0] >= limit:
            out.append(open_.pop(expert)[0])
    return out + [b for b, _ in open_.values()]


INPUT_SIDE = ("vision", "embedding")  # a part's modules forward runs first, though registered after its layers


def forward_order(parts: list[nn.Module]) -> list[torch.Tensor]:
    """The trainable parameters of ``parts`` about in the order forward first uses them (backward
    finishes them in reverse): each part's vision tower and embedding, then the rest as
    registered (its layers in order, the final norm, the output layer, the MTP depths)."""
    seen, out = set(), []
    for part in parts:
        first = [m for m in (getattr(part, name, None) for name in INPUT_SIDE) if isinstance(m, nn.Module)]
        for module in first + [part]:
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def tied_params(parts: list[nn.Module], groups: ParallelGroups) -> list[torch.Tensor]:
    """The embedding weights summed over the first and last pipeline stage (tied to the output
    layer, or read by the multi-token-prediction depths) before the data-parallel sum."""
    cfg = parts[0].config
    if comm.group_size(groups.embd) == 1 or not (cfg.tie_embeddings or cfg.mtp is not None):
        return []
    return [p for part in parts for n, p in part.named_parameters() if n == "embedding.weight"]


def materialize_grads(params) -> list[torch.Tensor]:
    """Zero grads for params that got none (e.g. an expert without tokens), so every DP
    replica reduces the same tensors."""
    out = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
    return out


def by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split by dtype (first-seen order; each list keeps theirs): a bucket's flat tensors."""
    out: dict = {}
    for x in tensors:
        out.setdefault(x.dtype, []).append(x)
    return list(out.values())


def all_reduce_bucketed(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in flat buckets (few large collectives)."""
    if comm.group_size(group) == 1 or not tensors:
        return
    bucket, count = [], 0
    for t in tensors + [None]:
        if t is not None:
            bucket.append(t)
            count += t.numel()
        if bucket and (t is None or count >= BUCKET_ELEMENTS):
            _reduce_now(bucket, group)
            bucket, count = [], 0


def _reduce_now(grads: list[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` now: one flat tensor per dtype."""
    for same in by_dtype(grads):
        flat = _flatten_dense_tensors(same)
        comm.all_reduce_tensor(flat, group)
        for x, y in zip(same, _unflatten_dense_tensors(flat, same)):
            x.copy_(y)


def sync_grads(parts: list[nn.Module], groups: ParallelGroups, bucket_elements: int = BUCKET_ELEMENTS) -> None:
    """Everything that makes local grads equal the single-process grads of this rank's shards,
    after the whole backward (the reference of ``train.overlap_grad_reduce``)."""
    with comm.tag_scope("grad_sync"):  # names these collectives in the communication monitor
        for part in parts:
            finalize_grads(part, groups)
        tied = tied_params(parts, groups)
        all_reduce_bucketed(materialize_grads(tied), groups.embd)
        for bucket in plan_buckets(parts, groups, bucket_elements):
            grads = materialize_grads(bucket.params)
            if comm.group_size(bucket.group) > 1:
                _reduce_now(grads, bucket.group)


def _counts_here(name: str, p: torch.Tensor, groups: ParallelGroups, part) -> bool:
    """Whether this rank's copy adds to the global norm: replicas are counted once."""
    split_over = {r.group for r in sharding(p)}
    if is_expert_param(p):
        return "etp" in split_over or groups.rank("etp") == 0
    if name == "embedding.weight" and not part.pre_process:
        return False  # the last stage's copy (tied, or the MTP's); counted on the first
    return "tp" in split_over or groups.tp_rank == 0


def global_grad_norm(parts: list[nn.Module], groups: ParallelGroups) -> float:
    """L2 norm of the full model's gradient, identical on every rank."""
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    seen = set()
    for part in parts:
        for name, p in part.named_parameters():
            if p.grad is None or id(p) in seen or not _counts_here(name, p, groups, part):
                continue
            seen.add(id(p))
            sq = p.grad.detach().double().pow(2).sum()
            if is_expert_param(p):
                expert += sq
            else:
                dense += sq
    with comm.tag_scope("grad_norm"):
        comm.all_reduce_tensor(dense, groups.mp)
        comm.all_reduce_tensor(expert, groups.emp)
    return math.sqrt((dense + expert).item())


def clip_grads(params: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    if max_norm > 0 and total_norm > max_norm:
        scale = max_norm / (total_norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
