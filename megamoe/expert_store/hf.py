"""Tiered experts read straight from an HF checkpoint directory (the one the model was imported
from): ``model.moe.expert_store.path = HF_DIR``. Nothing is converted and no expert is held
whole; a rank reads only its own experts' slices, when they are routed to.

The family's mapping table (``megamoe.convert``, an ``Experts`` rule with ``row_blocks``)
names each MoE layer's expert tensors in one of transformers' two layouts::

    per expert   {p}.experts.{E}.gate_proj.weight [F, h], .up_proj.weight [F, h], .down_proj.weight [h, F]
                 -> w1 [2f/etp, h] = gate rows | up rows of this rank's f-slice, w2 [h, f/etp] = down's columns
    stacked      {p}.experts.gate_up_proj [E, 2F, h], .down_proj [E, h, F]: megamoe's layout as it is

(the names per family: gate/up/down or Mixtral's w1/w3/w2 under ``block_sparse_moe``). Reads are
positioned reads at the safetensors header offsets, converted to the model's dtype (e.g. bf16
files under an fp32 model). With an expert placement (``model.moe.placement``) slot s reads
logical expert ``order[s]``. FP8 releases' per-expert tensors (e4m3 with ``weight_scale_inv``,
``megamoe.convert.quant``) are read as e4m3 rows plus their scales and dequantised into the
slot (about half of bf16's bytes read). Every file problem is one line naming the file.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megamoe.convert.api import open_hf, plan_entries
from megamoe.convert.quant import QuantFormat, row_scales
from megamoe.convert.table import Entry, Experts
from megamoe.core.errors import CheckpointError
from megamoe.core.placement import order_for
from megamoe.expert_store.source import DiskSource, ExpertTensors, read_scaled


def is_hf_dir(root: str | Path) -> bool:
    """An HF checkpoint directory (config.json) rather than a converted megamoe one (meta.json)."""
    root = Path(root)
    return (root / "config.json").is_file() and not (root / "meta.json").is_file()


class PerExpertTensors:
    """One tiered layer's experts as per-expert HF tensors: ``gate_up`` lists gate_0, up_0,
    gate_1, up_1, ... and ``down`` down_0, down_1, ... (the table's order). Every tensor's header
    entry is looked up and its shape checked once, here (headers only: nothing is read), not
    per expert read. ``scales``: {FP8 tensor: its scale tensor} in format ``fmt``."""

    def __init__(self, source: DiskSource, gate_up: list[str], down: list[str], f: int, h: int,
                 etp: tuple[int, int], order: list[int] | None = None, scales: dict[str, str] | None = None,
                 fmt: QuantFormat | None = None):
        self.source, self.f, self.h, self.order, self.fmt = source, f, h, order, fmt
        self.q, self.etp = etp
        self.gate_up = [self._entry(name, (f, h)) for name in gate_up]
        self.down = [self._entry(name, (h, f)) for name in down]
        scales = scales or {}
        self.scales = {e: source._entry(scales[n]) for n, e in zip(gate_up + down, self.gate_up + self.down)
                       if n in scales}

    def _entry(self, name: str, shape: tuple[int, int]):
        entry = self.source._entry(name)
        if entry.shape != shape:
            raise CheckpointError(f"{entry.file}: {name} has shape {list(entry.shape)}, "
                                  f"the model expects {list(shape)}")
        return entry

    def read(self, expert: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Global ``expert``'s slices into w1 [2f/etp, h] and w2 [h, f/etp] (contiguous, CPU)."""
        f, h, fl = self.f, self.h, self.f // self.etp
        expert = expert if self.order is None else self.order[expert]
        for part in range(2):  # gate, then up: this rank's rows of each
            self._rows(self.gate_up[2 * expert + part], self.q * fl, w1[part * fl:(part + 1) * fl])
        entry = self.down[expert]
        if self.etp == 1:
            self._rows(entry, 0, w2)
        else:  # [h, f] rows are strided in the f-slice: read the expert's down weight once, slice it
            whole = torch.empty(h, f, dtype=w2.dtype)
            self._rows(entry, 0, whole)
            w2.copy_(whole[:, self.q * fl:(self.q + 1) * fl])

    def _rows(self, entry, row: int, out: torch.Tensor) -> None:
        """Rows ``row`` .. of a 2-D tensor into ``out`` [rows, K]; an FP8 one dequantised with
        its scale (read whole: a block grid, a row or one value, small beside the weight)."""
        scale = self.scales.get(entry)
        if scale is None:
            self.source.read_into(entry, row * entry.shape[1], out)
            return
        stored = torch.empty(scale.shape, dtype=torch.float32)
        self.source.read_into(scale, 0, stored)
        rows = row_scales(self.fmt, entry.shape, stored)[row:row + out.size(0)]
        block = self.fmt.block[1] if self.fmt.block is not None else entry.shape[1]
        read_scaled(self.source, entry, row * entry.shape[1], rows.contiguous(), block, out)


def _rule(entry: Entry) -> Experts | None:
    rule = entry.rule
    if hasattr(rule, "rules"):  # OneOf: the layout the checkpoint holds
        rule = rule.rules[entry.ctx.variant]
    return rule if isinstance(rule, Experts) else None


def hf_expert_sources(root: str | Path, layers: dict, etp: tuple[int, int], placement: dict | None = None
                      ) -> tuple[DiskSource, dict]:
    """(the source, {layer name: reader}) for the tiered ``layers`` from the HF directory ``root``."""
    ck, family, cfg = open_hf(root)  # reads every shard's header: a missing or truncated shard fails here, named
    entries = {e.mm: e for e in plan_entries(family, cfg, ck.config, ck.names)}
    disk = DiskSource(root, files=ck.files, prefix="")
    readers = {}
    for name, m in layers.items():
        pair = [entries.get(f"{name}.{w}") for w in ("gate_up_weight", "down_weight")]
        if None in pair:
            raise CheckpointError(f"{root}: its {family.model_type} checkpoint has no experts for {name} "
                                  "(model.moe.expert_store.path is not the checkpoint the model was imported from?)")
        rules = [_rule(e) for e in pair]
        if not all(r is not None and r.row_blocks for r in rules):
            raise CheckpointError(f"{root}: {family.model_type} experts are not stored as plain row blocks; "
                                  "convert with megamoe-convert import-hf and use that checkpoint as the store")
        scales = getattr(ck, "scales", {})  # FP8 tensors and their scales (megamoe.convert.quant.DequantizedHF)
        for e in pair:
            for hf in e.hf:
                if ck.dtypes[hf] not in family.weight_dtypes or (hf in scales and e.ctx.stacked):
                    raise CheckpointError(f"{Path(root) / ck.files[hf]}: tensor {hf} is {ck.dtypes[hf]}, which the "
                                          "expert store does not read (integer weights, or stacked FP8 experts: "
                                          "convert with megamoe-convert import-hf --keep-fp8 and use that checkpoint)")
        order = order_for(f"{name}.gate_up_weight", placement or {},
                           torch.empty(m.num_experts, 0, device="meta"))
        gate_up, down = pair
        if gate_up.ctx.stacked:
            readers[name] = ExpertTensors(disk, name, m.num_experts, m.ffn_hidden_size, m.hidden_size, etp,
                                          tensors=(gate_up.hf[0], down.hf[0]), order=order)
        else:
            if len(gate_up.hf) != 2 * m.num_experts or len(down.hf) != m.num_experts:
                raise CheckpointError(f"{root}: {name} has {len(down.hf)} experts in the HF table, the model "
                                      f"{m.num_experts}")
            readers[name] = PerExpertTensors(disk, gate_up.hf, down.hf, m.ffn_hidden_size, m.hidden_size, etp, order,
                                             scales=scales, fmt=getattr(ck, "fmt", None))
    return disk, readers
