"""Gradient synchronisation and the global gradient norm over the whole grid.

Order after backward: TP-partial grads summed over TP (``finalize_grads``), the embedding's
grads summed over the first and last pipeline stage where the last holds a copy (tied to the
output layer, or read by the multi-token-prediction depths), then dense grads summed over the
data(-context)-parallel group and expert grads over the expert-data-parallel group. The
loss is normalised by the global token count, so sums (not averages) make every layout
equal the single-process run.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.record import is_expert_param  # noqa: F401  (also imported from here)
from megamoe.parallel.sharding import sharding
from megamoe.model.weights import finalize_grads

BUCKET_ELEMENTS = 1 << 24


def _materialize(params) -> list[torch.Tensor]:
    """Zero grads for params that got none (e.g. an expert without tokens), so every DP
    replica reduces the same tensors."""
    out = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
    return out


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
            by_dtype: dict = {}
            for x in bucket:
                by_dtype.setdefault(x.dtype, []).append(x)
            for same in by_dtype.values():
                flat = _flatten_dense_tensors(same)
                comm.all_reduce_tensor(flat, group)
                for x, y in zip(same, _unflatten_dense_tensors(flat, same)):
                    x.copy_(y)
            bucket, count = [], 0


def sync_grads(parts: list[nn.Module], groups: ParallelGroups) -> None:
    """Everything that makes local grads equal the single-process grads of this rank's shards."""
    with comm.tag_scope("grad_sync"):  # names these collectives in the communication monitor
        _sync_grads(parts, groups)


def _sync_grads(parts: list[nn.Module], groups: ParallelGroups) -> None:
    for part in parts:
        finalize_grads(part, groups)
    cfg = parts[0].config
    if groups.embd is not None and (cfg.tie_embeddings or cfg.mtp is not None):
        # the first stage's embedding and the last stage's copy (its output weight, or what the MTP reads) are one tensor
        tied = [p for part in parts for n, p in part.named_parameters() if n == "embedding.weight"]
        all_reduce_bucketed(_materialize(tied), groups.embd)
    params = unique_params(parts)
    dense = [p for p in params if not is_expert_param(p)]
    experts = [p for p in params if is_expert_param(p)]
    all_reduce_bucketed(_materialize(dense), groups.dp_cp)
    all_reduce_bucketed(_materialize(experts), groups.edp)


def unique_params(parts: list[nn.Module]) -> list[torch.Tensor]:
    seen, out = set(), []
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                out.append(p)
    return out


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
