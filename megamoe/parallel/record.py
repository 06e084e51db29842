"""One record per parameter: the facts megamoe keeps beside a parameter's values.

==================  ==========================================================================
field               meaning (who reads it)
==================  ==========================================================================
``shard``           ordered ``Shard`` rules: how the full tensor splits over the grid
                    (initialisation, checkpoints, conversion, gradient sync)
``partial_grad``    groups over which each rank's gradient is a partial sum
                    (``megamoe.model.weights.finalize_grads`` sums it over them, in order)
``init``            the init rule, a function of a ``Draw`` (``megamoe.model.weights.initialize``)
``active_fraction`` share of the tokens that use it: routed experts top_k / E (the budget)
``stored``          its values live in the expert store (``megamoe.expert_store``): a meta-device
                    placeholder that is never initialised, loaded, saved or moved
==================  ==========================================================================

The record is a frozen dataclass stored as ``param._megamoe``; ``update_record`` stores a new
one, so a record is never shared between parameters or changed behind a reader's back. The
setters people call (``set_sharding``, ``mark_partial_grad``, ``mark_init``,
``mark_active_fraction``) are thin wrappers over it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class ParamRecord:
    shard: tuple = ()
    partial_grad: tuple[str, ...] = ()
    init: Callable | None = None
    active_fraction: float = 1.0
    stored: bool = False


_NONE = ParamRecord()


def record(param: torch.Tensor) -> ParamRecord:
    """The parameter's record (an empty one when nothing was declared)."""
    return getattr(param, "_megamoe", _NONE)


def update_record(param: torch.Tensor, **fields: Any) -> torch.Tensor:
    """Store a record with ``fields`` changed; returns the parameter."""
    param._megamoe = replace(record(param), **fields)
    return param


def mark_active_fraction(param: torch.Tensor, fraction: float) -> torch.Tensor:
    """Only ``fraction`` of the tokens use ``param`` (routed experts: top_k / E), as the budget counts it."""
    return update_record(param, active_fraction=fraction)


def is_expert_param(param: torch.Tensor) -> bool:
    """Routed-expert weights (and their per-expert adapters): split over the expert groups,
    replicated over expert-DP, so their gradients are reduced over ``edp``."""
    return any(r.group in ("ep", "etp") for r in record(param).shard)
