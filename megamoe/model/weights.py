"""Weights across layouts: shard-local, layout-independent init, full <-> sharded state dicts, grad sync.

All of it is driven by the ``Shard`` rules each parameter declares, so the same code
serves every parallel layout, checkpoints and conversion.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.core.errors import CheckpointError
from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.init_rng import draw_blocks, key_of
from megamoe.parallel.record import record
from megamoe.parallel.sharding import (KEEP, full_shape, gather_full, global_positions, partial_grad_groups,
                                       shard_full)


def unique_named_parameters(model: nn.Module):
    """(name, param) once per tensor (tied weights appear under their first name)."""
    return model.named_parameters(remove_duplicate=True)


@torch.no_grad()
def initialize(model: nn.Module, groups: ParallelGroups, seed: int = 0, select=None) -> None:
    """Draw each rank's own piece of every parameter, block by block, at the positions it has
    in the full tensor (``megamoe.parallel.init_rng``): every parallel layout starts from the
    same weights and no rank holds more than its shard. Parameters on the meta device are
    skipped; ``select(name)`` limits it to some parameters (e.g. adapters added to loaded
    weights)."""
    for name, p in unique_named_parameters(model):
        if p.is_meta or (select is not None and not select(name)):
            continue
        fn = record(p).init
        if fn is None:
            raise RuntimeError(f"parameter {name} has no init rule (mark_init)")
        if fn is KEEP:
            continue
        key = key_of(seed, name)
        for rows, draw, pad in draw_blocks(key, global_positions(p, groups), full_shape(p, groups)):
            values = fn(draw)
            if pad is not None:
                values = values.masked_fill(pad, 0.0)
            p[rows].copy_(values)


@torch.no_grad()
def full_state_dict(model: nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Unsharded copy of every parameter (a collective: call on all ranks)."""
    return {name: gather_full(p, groups).clone() for name, p in unique_named_parameters(model)}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], groups: ParallelGroups,
                         strict: bool = True) -> None:
    """Copy each rank's piece of full tensors into the model; names and shapes are checked."""
    params = dict(unique_named_parameters(model))
    if strict:
        missing = sorted(set(params) - set(state))
        if missing:
            raise CheckpointError(f"state dict lacks tensor {missing[0]} (and {len(missing) - 1} more)")
    for name, p in params.items():
        if name not in state:
            continue
        full = state[name]
        want = full_shape(p, groups)
        if list(full.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {list(full.shape)}, model expects {want}")
        p.copy_(shard_full(full.to(p.dtype), p, groups))


def finalize_grads(model: nn.Module, groups: ParallelGroups) -> None:
    """Sum the gradients of replicated params that saw only part of the work over the groups
    they are marked with (``mark_partial_grad``): over TP for a sequence shard under SP or a
    rank's heads, over ETP for LoRA factors shared by an expert's slices."""
    for p in model.parameters():
        if p.grad is None:
            continue
        for name in partial_grad_groups(p):
            comm.all_reduce_tensor(p.grad, getattr(groups, name))
