"""Expert placement: which experts share an EP rank, chosen from their measured load.

Routed experts are split over EP ranks in blocks of consecutive slots (rank r holds slots
r*E/ep .. (r+1)*E/ep - 1). A placement is, per MoE layer, the order of the experts in those
slots: ``order[s]`` = the expert (its index in the HF checkpoint, the "logical" expert) held
in slot s. Permuting the router's rows, the expert bias and the expert stacks the same way
leaves every output unchanged (the router picks the same expert, now at another index), so
a placement is a property of how weights are laid out, like TP or EP sharding:

- ``model.moe.placement`` ({layer: order}) records it in the model config (and so in every
  checkpoint's meta.json; resume guards refuse a change);
- the converter applies it when it reads an HF checkpoint (``from_hf`` / ``import_hf`` with
  ``placement=``) and undoes it when it writes one (``to_hf`` / ``export_hf``), so HF files
  always hold the logical order.

The load comes from a calibration pass (``calibrate``: tokens routed to each expert over
some batches) saved as JSON ``{"layers": {"3": [tokens per expert, ...], ...}}``;
``balanced_order`` assigns the heaviest experts first, each to the least loaded rank with a
free slot (LPT with equal capacities), which bounds the busiest rank's load near the mean.
Group-limited routing (``n_group > 1``) ties experts to contiguous groups, so it takes no
placement.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import torch

from megamoe.core.errors import ConfigError

_EXPERT_TENSOR = re.compile(r"^layers\.(\d+)\.mlp\.(router\.weight|router\.expert_bias|experts\.[A-Za-z_]+)$")


def balanced_order(load: Sequence[float], ep: int) -> list[int]:
    """Expert ids in slot order: heaviest first, each to the least-loaded rank with room
    (ties: the lower rank); within a rank, ascending ids."""
    n = len(load)
    if ep < 1 or n % ep:
        raise ConfigError(f"--ep={ep} must divide the {n} experts")
    per, totals = n // ep, [0.0] * ep
    ranks: list[list[int]] = [[] for _ in range(ep)]
    for e in sorted(range(n), key=lambda i: (-float(load[i]), i)):
        r = min((r for r in range(ep) if len(ranks[r]) < per), key=lambda r: (totals[r], r))
        ranks[r].append(e)
        totals[r] += float(load[e])
    return [e for r in ranks for e in sorted(r)]


def rank_loads(load: Sequence[float], order: Sequence[int], ep: int) -> list[float]:
    per = len(order) // ep
    return [sum(float(load[e]) for e in order[r * per:(r + 1) * per]) for r in range(ep)]


def imbalance(load: Sequence[float], order: Sequence[int], ep: int) -> float:
    """Busiest EP rank's load / the mean rank load (1 = perfectly even)."""
    per_rank = rank_loads(load, order, ep)
    mean = sum(per_rank) / ep
    return max(per_rank) / mean if mean else 1.0


# ---- files ----------------------------------------------------------------------------------

def _read_layers(path: str | Path, what: str) -> dict[int, list]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what} file") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a JSON {what} file ({e})") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ConfigError(f'{path}: a {what} file holds {{"layers": {{"<layer>": [...], ...}}}}')
    out = {}
    for key, values in layers.items():
        if not str(key).isdigit() or not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: layers.{key} must be a layer number with a non-empty list")
        out[int(key)] = values
    return out


def read_load(path: str | Path) -> dict[int, list[float]]:
    load = _read_layers(path, "expert-load")
    for layer, values in load.items():
        if not all(isinstance(v, (int, float)) and v >= 0 for v in values):
            raise ConfigError(f"{path}: layers.{layer}: loads must be numbers >= 0")
    return load


def write_json(path: str | Path, layers: dict[int, list]) -> None:
    Path(path).write_text(json.dumps({"layers": {str(k): list(v) for k, v in sorted(layers.items())}}) + "\n")


def read_placement(path: str | Path) -> dict[int, list[int]]:
    return _read_layers(path, "placement")


def check_placement(placement: dict, num_experts: int, moe_layers: Sequence[int], n_group: int = 1,
                    path: str = "model.moe.placement") -> dict[int, list[int]]:
    """{layer: order} with int keys, every order a permutation of the experts of a MoE layer."""
    if placement and n_group > 1:
        raise ConfigError(f"{path}: group-limited routing (n_group={n_group}) ties experts to their groups; "
                          "it takes no placement")
    out = {}
    for key, order in (placement or {}).items():
        layer = int(key)
        if layer not in moe_layers:
            raise ConfigError(f"{path}: layer {layer} is not a MoE layer (MoE layers: {list(moe_layers)})")
        if sorted(order) != list(range(num_experts)):
            raise ConfigError(f"{path}: layer {layer} must order each of the {num_experts} experts once")
        out[layer] = [int(e) for e in order]
    return out


# ---- applying it to tensors --------------------------------------------------------------------

def _order_for(name: str, placement: dict, tensor: torch.Tensor) -> list[int] | None:
    m = _EXPERT_TENSOR.match(name)
    if not m or not placement:
        return None
    order = placement.get(int(m.group(1)), placement.get(m.group(1)))
    if order is None or tensor.dim() == 0 or tensor.size(0) != len(order):
        return None
    return order


def to_slots(name: str, full: torch.Tensor, placement: dict) -> torch.Tensor:
    """A full tensor in logical expert order (as HF holds it) -> slot order."""
    order = _order_for(name, placement, full)
    return full if order is None else full.index_select(0, torch.tensor(order))


def to_logical(name: str, full: torch.Tensor, placement: dict) -> torch.Tensor:
    """A full tensor in slot order -> the logical expert order."""
    order = _order_for(name, placement, full)
    if order is None:
        return full
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return full.index_select(0, inverse)


# ---- calibration ----------------------------------------------------------------------------------

@torch.no_grad()
def calibrate(model, batches) -> dict[int, list[float]]:
    """Tokens routed to each expert (slot order of ``model``) per MoE layer, over ``batches``
    of input ids [b, s], in eval mode."""
    from megamoe.model.moe_controls import routers

    counts: dict[int, torch.Tensor] = {}

    def hook(router, inputs, out):
        n = router.cfg.num_experts
        c = torch.bincount(out.idx.reshape(-1).cpu(), minlength=n).double()
        counts[router.layer_number] = counts.get(router.layer_number, 0) + c

    handles = [r.register_forward_hook(hook) for r in routers(model)]
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {layer: c.tolist() for layer, c in sorted(counts.items())}
