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

These are the rules (validation, the JSON files, the permutation of a tensor); choosing an
order from measured load is ``megamoe.planning.placement``. Group-limited routing
(``n_group > 1``) picks each token's best groups of contiguous slots, and a group's score does
not depend on where the group sits: a placement that keeps every group in one block of slots
(whole groups moved between blocks, experts moved inside their group) routes every token to
the same experts. Blocks are contiguous slots, and EP ranks and nodes hold contiguous slots, so
such a placement keeps each group on as few ranks (and nodes) as before.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import torch

from megamoe.core.errors import ConfigError
from megamoe.core.untrusted import read_json

_EXPERT_TENSOR = re.compile(r"^layers\.(\d+)\.mlp\.(router\.weight|router\.expert_bias|experts\.[A-Za-z_]+)$")


# ---- files ----------------------------------------------------------------------------------

def _read_file(path: str | Path, what: str):
    """The JSON value of a load or placement file, bounded (``megamoe.core.untrusted.read_json``)."""
    try:
        return read_json(path, ConfigError, missing=f"no such {what} file")
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a JSON {what} file ({e})") from None


def _read_layers(path: str | Path, what: str) -> dict[int, list]:
    data = _read_file(path, what)
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


def write_json(path: str | Path, layers: dict[int, list], replicas: dict[int, list] | None = None) -> None:
    """{"layers": {layer: list}} (a load or a placement), with a placement's "replicas" {layer: list}."""
    data = {"layers": {str(k): list(v) for k, v in sorted(layers.items())}}
    if replicas:
        data["replicas"] = {str(k): list(v) for k, v in sorted(replicas.items())}
    tmp = Path(f"{path}.tmp")  # never a half-written file
    tmp.write_text(json.dumps(data) + "\n")
    tmp.replace(path)


def logical_load(load: dict, placement: dict | None) -> dict[int, list[float]]:
    """Tokens per slot {layer: [...]} (a placed model's router order) -> per HF expert, as a load
    file holds them (a training run's counts planned like a calibration's)."""
    out = {}
    for layer, counts in load.items():
        order, counts = layer_entry(placement, layer), [float(c) for c in counts]
        if order is not None:
            counts = [counts[order.index(e)] for e in range(len(counts))]
        out[int(layer)] = counts
    return out


def read_placement(path: str | Path) -> dict[int, list[int]]:
    return _read_layers(path, "placement")


def read_replicas(path: str | Path) -> dict[int, list[int]] | None:
    """A placement file's "replicas" ({layer: [expert ids of the redundant slots]}), None if it has none;
    every layer the same number (``model.moe.redundant_experts``)."""
    data = _read_file(path, "placement")
    replicas = data.get("replicas") if isinstance(data, dict) else None
    if replicas is None:
        return None
    ids = lambda v: isinstance(v, list) and all(isinstance(e, int) for e in v)  # noqa: E731
    if not isinstance(replicas, dict) or not all(str(k).isdigit() and ids(v) for k, v in replicas.items()):
        raise ConfigError(f'{path}: "replicas" must be {{"<layer>": [expert ids], ...}}')
    if len({len(v) for v in replicas.values()}) > 1:
        raise ConfigError(f"{path}: every layer's replicas must have the same length (model.moe.redundant_experts)")
    return {int(k): v for k, v in replicas.items()}


def check_placement(placement: dict, num_experts: int, moe_layers: Sequence[int], n_group: int = 1,
                    path: str = "model.moe.placement") -> dict[int, list[int]]:
    """{layer: order} with int keys, every order a permutation of the experts of a MoE layer
    (with group-limited routing, one that keeps each group in one block of slots)."""
    out = {}
    for key, order in (placement or {}).items():
        layer = int(key)
        if layer not in moe_layers:
            raise ConfigError(f"{path}: layer {layer} is not a MoE layer (MoE layers: {list(moe_layers)})")
        if sorted(order) != list(range(num_experts)):
            raise ConfigError(f"{path}: layer {layer} must order each of the {num_experts} experts once")
        out[layer] = [int(e) for e in order]
        split = split_group(out[layer], n_group)
        if split is not None:
            raise ConfigError(f"{path}: layer {layer} splits expert group {split} over slot blocks (group-limited "
                              f"routing, n_group={n_group}: each group's {num_experts // n_group} experts must fill "
                              "one block of slots)")
    return out


def split_group(order: Sequence[int], n_group: int) -> int | None:
    """The first expert group that ``order`` does not keep in one block of slots, else None."""
    size = len(order) // n_group
    for start in range(0, len(order), size):
        groups = {int(e) // size for e in order[start:start + size]}
        if len(groups) > 1:
            return min(groups)
    return None


# ---- applying it to tensors --------------------------------------------------------------------

def order_for(name: str, placement: dict, tensor: torch.Tensor) -> list[int] | None:
    """The slot order of the expert tensor ``name`` (None: not an expert tensor, or no placement
    for its layer)."""
    m = _EXPERT_TENSOR.match(name)
    if not m or not placement:
        return None
    order = layer_entry(placement, int(m.group(1)))
    if order is None or tensor.dim() == 0 or tensor.size(0) != len(order):
        return None
    return order


def to_slots(name: str, full: torch.Tensor, placement: dict) -> torch.Tensor:
    """A full tensor in logical expert order (as HF holds it) -> slot order."""
    order = order_for(name, placement, full)
    return full if order is None else full.index_select(0, torch.tensor(order))


def to_logical(name: str, full: torch.Tensor, placement: dict) -> torch.Tensor:
    """A full tensor in slot order -> the logical expert order."""
    order = order_for(name, placement, full)
    if order is None:
        return full
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return full.index_select(0, inverse)


# ---- redundant experts (replicas of hot experts) ------------------------------------------------
#
# ``model.moe.redundant_experts=N`` adds N expert slots, N/ep on each EP rank, each holding a copy
# of an expert (``model.moe.replicas`` {layer: [N HF expert ids]}, entry i on EP rank i // (N/ep)).
# Rank r then holds S/ep = E/ep + N/ep slots, global slot ids r*S/ep ..: first its E/ep own
# experts (the placement's block), then its N/ep replicas. Only the E experts are parameters
# (checkpoints and HF files hold each expert once); ``megamoe.layers.mlp.replicas`` fills the
# replica slots from their owners in every forward.

def default_replicas(num_experts: int, n: int) -> list[int]:
    """Replicas without a measured load: spread over the ids, each half the id range away from its
    expert, so that an extra slot rarely lands on the rank that owns its expert."""
    return [(i * num_experts // n + num_experts // 2) % num_experts for i in range(n)]


def check_replicas(replicas: dict | None, n: int, num_experts: int, moe_layers: Sequence[int],
                   path: str = "model.moe.replicas") -> dict[int, list[int]]:
    """{layer: [n expert ids]} with int keys; every layer a MoE layer, every id an expert."""
    out = {}
    for key, ids in (replicas or {}).items():
        layer = int(key)
        if layer not in moe_layers:
            raise ConfigError(f"{path}: layer {layer} is not a MoE layer (MoE layers: {list(moe_layers)})")
        if not isinstance(ids, (list, tuple)) or len(ids) != n or not all(
                isinstance(e, int) and 0 <= e < num_experts for e in ids):
            raise ConfigError(f"{path}: layer {layer} must list model.moe.redundant_experts={n} expert ids in "
                              f"[0, {num_experts})")
        out[layer] = [int(e) for e in ids]
    return out


def layer_entry(table: dict | None, layer: int):
    """``table``'s entry for ``layer`` (keys are ints, or strings as in YAML and meta.json)."""
    table = table or {}
    return table.get(layer, table.get(str(layer)))


def router_index(experts: Sequence[int], order: Sequence[int] | None) -> list[int]:
    """HF expert ids -> their indices in the router (slots of the placement ``order``)."""
    if order is None:
        return [int(e) for e in experts]
    where = {int(e): s for s, e in enumerate(order)}
    return [where[int(e)] for e in experts]


def replica_slots(num_experts: int, replicas: Sequence[int], ep: int) -> list[list[int]]:
    """The global slot ids of each expert's copies (router indices; its own slot first), for
    ``replicas`` (router indices, entry i on EP rank i // (N/ep)) over ``ep`` ranks."""
    own, extra = num_experts // ep, len(replicas) // ep
    per_rank = own + extra
    slots = [[(e // own) * per_rank + e % own] for e in range(num_experts)]
    for i, e in enumerate(replicas):
        slots[e].append((i // extra) * per_rank + own + i % extra)
    return slots
