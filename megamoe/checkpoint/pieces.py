"""Naming and reassembling the pieces of a tensor split over the grid, for any layout.

A tensor with ``Shard`` rules is stored as one piece per combination of ranks of the groups
it is split over, under ``<kind>/<name>#tp1of2.ep0of2`` (groups of size one are left out, so
an unsplit tensor is just ``<kind>/<name>``). Both checkpoint formats (DCP training
checkpoints and converted safetensors checkpoints) use these keys, so either resumes at any
layout: read the old pieces, ``assemble`` the full tensor, ``split_full`` the new piece.
"""
from __future__ import annotations

from typing import Callable

import torch

from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.sharding import join_one

GROUPS = ("tp", "pp", "dp", "cp", "ep", "etp", "edp")


def layout_sizes(groups: ParallelGroups) -> dict[str, int]:
    return {g: groups.size(g) for g in GROUPS}


def my_ranks(groups: ParallelGroups) -> dict[str, int]:
    return {g: groups.rank(g) for g in GROUPS}


def piece_key(kind: str, name: str, rules, ranks: dict[str, int], sizes: dict[str, int]) -> str:
    bits = [f"{r.group}{ranks[r.group]}of{sizes[r.group]}" for r in rules if sizes.get(r.group, 1) > 1]
    return f"{kind}/{name}#{'.'.join(bits)}" if bits else f"{kind}/{name}"


def all_pieces(rules, sizes: dict[str, int]) -> list[dict[str, int]]:
    """Every combination of ranks over the groups a tensor is split over."""
    combos: list[dict[str, int]] = [{}]
    for r in rules:
        n = sizes.get(r.group, 1)
        combos = [{**c, r.group: i} for c in combos for i in range(n)]
    return combos


def unchanged(rules, old_sizes: dict[str, int], groups: ParallelGroups, stored=None) -> bool:
    """The tensor is split now as it was when stored: a rank reads its own piece. ``stored``:
    the rules it was stored under when they may differ from the model's (``stored_rules``)."""
    if stored is not None and tuple(stored) != tuple(rules):
        return False
    return all(old_sizes.get(r.group, 1) == groups.size(r.group) for r in rules)


def assemble(read: Callable[[str], torch.Tensor], kind: str, name: str, rules, sizes: dict[str, int]
             ) -> torch.Tensor:
    """Full tensor from its stored pieces; ``read(key)`` returns one piece."""

    def build(level: int, fixed: dict[str, int]) -> torch.Tensor:
        if level == len(rules):
            return read(piece_key(kind, name, rules, fixed, sizes))
        rule = rules[level]
        n = sizes.get(rule.group, 1)
        parts = [build(level + 1, {**fixed, rule.group: i}) for i in range(n)]
        if n == 1 and rule.unpadded is None:
            return parts[0]
        return join_one(parts, rule)

    return build(0, {})


def stored_rules(rules, kind: str, name: str, sizes: dict[str, int], has_key: Callable[[str], bool]):
    """The rules a tensor was stored under: the model's, or none when it was stored whole and
    the model now splits it (a vision tower converted replicated, trained with
    ``model.vision.parallel.tp > 1``). The whole tensor is then read and split."""
    if not rules or has_key(piece_key(kind, name, rules, {r.group: 0 for r in rules}, sizes)):
        return rules
    return () if has_key(f"{kind}/{name}") else rules
