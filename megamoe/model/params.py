"""Parameter budget: total and active-per-token counts, per layer and overall.

Counts are of the full (unsharded) model whatever the layout. A parameter marked with
``megamoe.parallel.record.mark_active_fraction`` (routed experts: top_k / num_experts) counts that fraction towards
the active budget; everything else is active for every token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.record import record
from megamoe.parallel.sharding import full_shape


@dataclass
class ParamBudget:
    total: int = 0
    active: float = 0.0
    parts: dict = field(default_factory=dict)  # name -> (total, active)

    def add(self, part: str, total: int, active: float) -> None:
        t, a = self.parts.get(part, (0, 0.0))
        self.parts[part] = (t + total, a + active)
        self.total += total
        self.active += active


def _part_name(param_name: str) -> str:
    bits = param_name.split(".")
    if bits[0] in ("layers", "mtp"):  # a layer, or a multi-token-prediction depth (megamoe.model.mtp)
        return f"{bits[0]}.{bits[1]}"
    return bits[0]


def count_parameters(model: nn.Module, groups: ParallelGroups | None = None) -> ParamBudget:
    groups = groups or ParallelGroups()
    budget = ParamBudget()
    for name, p in model.named_parameters(remove_duplicate=True):
        n = math.prod(full_shape(p, groups))
        frac = record(p).active_fraction
        budget.add(_part_name(name), n, n * frac)
    return budget


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_budget(budget: ParamBudget, layer_kinds: dict[str, str] | None = None) -> str:
    """A table: one row per layer (with its kind) and the embedding/head, then the totals."""
    rows = [f"{'part':<14}{'kind':<6}{'total':>12}{'active':>12}"]
    for part, (t, a) in budget.parts.items():
        kind = (layer_kinds or {}).get(part, "")
        rows.append(f"{part:<14}{kind:<6}{human(t):>12}{human(a):>12}")
    rows.append(f"{'TOTAL':<20}{human(budget.total):>12}{human(budget.active):>12}")
    rows.append(f"total parameters: {budget.total:,}  active per token: {int(round(budget.active)):,}")
    return "\n".join(rows)
