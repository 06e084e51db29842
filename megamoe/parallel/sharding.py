"""How each parameter is split over the grid, declared in its record (``megamoe.parallel.record``).

A parameter carries an ordered list of ``Shard`` rules (e.g. stacked experts: first over
``ep`` along dim 0, then over ``etp`` along dim 1). The same rules serve initialisation
(each rank draws its own piece at the full tensor's positions, so every layout starts
from the same weights), checkpoint resharding and HF conversion.

Fused tensors (gate|up, q|k|v parts) are split part by part: ``parts`` gives the sizes of
the parts along ``dim`` in the full tensor; each rank keeps its slice of every part.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.init_rng import Draw, InitFn
from megamoe.parallel.record import record, update_record


@dataclass(frozen=True)
class Shard:
    dim: int
    group: str  # field name of ParallelGroups: tp, ep, etp, ...
    parts: tuple[int, ...] | None = None  # full sizes of fused parts along dim
    unpadded: int | None = None  # true full size when the dim is zero-padded to a multiple (vocab)


def set_sharding(param: torch.Tensor, *rules: Shard) -> torch.Tensor:
    return update_record(param, shard=tuple(rules))


def sharding(param: torch.Tensor) -> tuple[Shard, ...]:
    return record(param).shard


def mark_partial_grad(param: torch.Tensor, group: str) -> torch.Tensor:
    """Replicated over ``group`` (a ParallelGroups field), but each rank's gradient is a partial
    sum: ``finalize_grads`` sums it over that group. E.g. a LoRA ``A`` shared by the expert-tensor
    slices of one expert, each slice contributing its own part of the gradient."""
    return update_record(param, partial_grad=tuple(dict.fromkeys((*partial_grad_groups(param), group))))


def partial_grad_groups(param: torch.Tensor) -> tuple[str, ...]:
    """The groups ``finalize_grads`` sums this parameter's gradient over (in order)."""
    return record(param).partial_grad


def mark_tp_partial_grad(param: torch.Tensor) -> torch.Tensor:
    """Replicated over TP, but each rank's gradient is a partial sum (the rank saw only a
    sequence shard under SP, or only its own heads): ``finalize_grads`` sums it over TP."""
    return mark_partial_grad(param, "tp")


def has_tp_partial_grad(param: torch.Tensor) -> bool:
    return "tp" in partial_grad_groups(param)


# ---- init rules --------------------------------------------------------------------------

# A rule maps a ``Draw`` (the random source of a block of the shard, positioned in the full
# tensor: megamoe.parallel.init_rng) to the block's float32 values; rules are elementwise in
# the draws, so any block of any shard comes out as the full tensor's values there.


def normal_init(std: float) -> InitFn:
    return lambda draw: draw.normal().mul_(std)


def const_init(value: float) -> InitFn:
    return lambda draw: torch.full(draw.shape, float(value))


def uniform_init(low: float, high: float) -> InitFn:
    return lambda draw: draw.uniform().mul_(high - low).add_(low)


def KEEP(draw: Draw) -> torch.Tensor:  # noqa: N802 - a sentinel rule, compared by identity
    """The rule that keeps what the parameter holds (a tower built by timm under its own seed,
    or loaded weights): ``initialize`` skips it."""
    raise AssertionError("KEEP is never called: initialize skips it")


def mark_init(param: torch.Tensor, fn: InitFn) -> torch.Tensor:
    return update_record(param, init=fn)


# ---- split / join ------------------------------------------------------------------------

def split_one(full: torch.Tensor, rule: Shard, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` under one rule over ``size`` ranks (padded, part by part)."""
    if rule.unpadded is not None and full.size(rule.dim) % size:
        pad = list(full.shape)
        pad[rule.dim] = -full.size(rule.dim) % size
        full = torch.cat([full, full.new_zeros(pad)], dim=rule.dim)
    parts = rule.parts or (full.size(rule.dim),)
    if sum(parts) != full.size(rule.dim):
        raise ValueError(f"parts {parts} do not add up to dim {rule.dim} of size {full.size(rule.dim)}")
    pieces = []
    for chunk in full.split(list(parts), dim=rule.dim):
        if chunk.size(rule.dim) % size:
            raise ValueError(f"dim {rule.dim} part of size {chunk.size(rule.dim)} is not divisible "
                             f"by {rule.group} size {size}")
        pieces.append(chunk.chunk(size, dim=rule.dim)[rank])
    return torch.cat(pieces, dim=rule.dim) if len(pieces) > 1 else pieces[0]


def join_one(locals_: Sequence[torch.Tensor], rule: Shard) -> torch.Tensor:
    """The inverse of ``split_one``: every rank's piece, in rank order -> the tensor before the rule."""
    size = len(locals_)
    parts = rule.parts or (locals_[0].size(rule.dim) * size,)
    local_parts = [p // size for p in parts]
    per_part = [list(t.split(local_parts, dim=rule.dim)) for t in locals_]
    full = torch.cat([torch.cat([per_part[r][i] for r in range(size)], dim=rule.dim)
                      for i in range(len(parts))], dim=rule.dim)
    if rule.unpadded is not None:
        full = full.narrow(rule.dim, 0, rule.unpadded)
    return full


def split_full(full: torch.Tensor, rules: Sequence[Shard], groups: ParallelGroups) -> torch.Tensor:
    """This rank's piece of ``full`` under ``rules``."""
    out = full
    for rule in rules:
        out = split_one(out, rule, groups.rank(rule.group), groups.size(rule.group))
    return out


def shard_full(full: torch.Tensor, param: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """The local piece of ``full`` for ``param`` on this rank."""
    out = split_full(full, sharding(param), groups)
    if tuple(out.shape) != tuple(param.shape):
        raise ValueError(f"full shape {tuple(full.shape)} gives local {tuple(out.shape)}, "
                         f"parameter holds {tuple(param.shape)}")
    return out


def gather_full(param: torch.Tensor, groups: ParallelGroups, tensor: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The full tensor from every rank's piece of ``param`` (or of ``tensor`` sharded like it,
    e.g. its gradient). A collective over the param's groups."""
    from megamoe.parallel.comm import all_gather_tensor

    out = (param if tensor is None else tensor).detach()
    for rule in reversed(sharding(param)):
        group = getattr(groups, rule.group)
        size = groups.size(rule.group)
        if size == 1 and rule.unpadded is None:
            continue
        gathered = all_gather_tensor(out, rule.dim, group)
        out = join_one(list(gathered.chunk(size, dim=rule.dim)), rule)
    return out


def full_shape(param: torch.Tensor, groups: ParallelGroups) -> list[int]:
    """Shape of the unsharded, unpadded tensor."""
    shape = list(param.shape)
    for rule in sharding(param):
        shape[rule.dim] *= groups.size(rule.group)
        if rule.unpadded is not None:
            shape[rule.dim] = rule.unpadded
    return shape


def _positions_before(pos: torch.Tensor, rule: Shard, size_in: int, rank: int, size: int) -> torch.Tensor:
    """Positions along ``rule.dim`` before the split, of a rank's entries at positions ``pos``
    after it (-1: padding, kept)."""
    padded = size_in + (-size_in % size if rule.unpadded is not None else 0)
    parts = rule.parts or (padded,)
    local = torch.tensor([p // size for p in parts])
    local_start = torch.cumsum(local, 0) - local
    full_start = torch.cumsum(torch.tensor(parts), 0) - torch.tensor(parts)
    part = torch.searchsorted(torch.cumsum(local, 0), pos.clamp_min(0), right=True)
    out = full_start[part] + rank * local[part] + pos.clamp_min(0) - local_start[part]
    if rule.unpadded is not None:
        out = torch.where(out < rule.unpadded, out, -1)
    return torch.where(pos < 0, -1, out)


def global_positions(param: torch.Tensor, groups: ParallelGroups) -> list[torch.Tensor]:
    """Per dim, the full-tensor positions [local size] of this rank's entries of ``param``
    (-1 for padding). The local piece is their outer product: what ``split_full`` keeps."""
    sizes_in, shape = [], full_shape(param, groups)
    for rule in sharding(param):                      # each rule's input size along its dim
        sizes_in.append(shape[rule.dim])
        n = groups.size(rule.group)
        shape[rule.dim] = (shape[rule.dim] + (-shape[rule.dim] % n if rule.unpadded is not None else 0)) // n
    pos = [torch.arange(n) for n in param.shape]
    for rule, size_in in reversed(list(zip(sharding(param), sizes_in))):
        pos[rule.dim] = _positions_before(pos[rule.dim], rule, size_in, groups.rank(rule.group),
                                          groups.size(rule.group))
    return pos


