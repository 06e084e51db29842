"""Converted megamoe checkpoints: safetensors shards of megamoe-named tensor pieces.

    OUT/meta.json                         format, model config, layout, HF origin
    OUT/model-pp00-00001-of-00003.safetensors ...   pieces of pipeline stage 0, in model order
    OUT/model.safetensors.index.json      piece key -> shard

Keys are ``model/<name>`` or, when the checkpoint was resharded at import
(``--tp/--ep/--etp/--pp``), ``model/<name>#tp1of2...`` (megamoe.checkpoint.pieces), so each
rank reads its own pieces; any other layout reassembles them. The trainer loads this format
through ``checkpoint.load`` like its own checkpoints.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterator

import torch

from megamoe.checkpoint.hf_io import INDEX, read_weight_map, write_index, write_sharded
from megamoe.checkpoint.safetensors_io import nbytes, read_tensor
from megamoe.core.errors import CheckpointError
from megamoe.core.untrusted import member
from megamoe.parallel.groups import ParallelGroups
from megamoe.checkpoint.pieces import all_pieces, assemble, my_ranks, piece_key, stored_rules, unchanged
from megamoe.parallel.sharding import Shard, split_one, split_full

FORMAT = "megamoe-safetensors"


def split_pieces(full: torch.Tensor, rules: tuple[Shard, ...], sizes: dict[str, int]
                 ) -> Iterator[tuple[dict[str, int], torch.Tensor]]:
    """(ranks, piece) for every combination of ranks of the groups ``rules`` split over."""
    for combo in all_pieces(rules, sizes):
        out = full
        for rule in rules:
            out = split_one(out, rule, combo.get(rule.group, 0), sizes.get(rule.group, 1))
        yield combo, out


def stage_of(name: str, stages: list[list[int]]) -> int:
    bits = name.split(".")
    if bits[0] == "layers":
        return next(i for i, ids in enumerate(stages) if int(bits[1]) in ids)
    if bits[0] in ("final_norm", "output_layer"):
        return len(stages) - 1
    return 0


def write_checkpoint(out: Path, meta: dict, tensors: list[tuple[str, torch.dtype, tuple, tuple]],
                     produce: Callable[[str], torch.Tensor], sizes: dict[str, int], stages: list[list[int]],
                     shard_bytes: int, progress=None) -> None:
    """Write ``tensors`` (name, dtype, full shape, shard rules), each produced on demand by
    ``produce(name)`` and split into the pieces of layout ``sizes``; one full tensor in memory
    at a time."""
    weight_map, total = {}, 0
    for stage in range(len(stages)):
        mine = [t for t in tensors if stage_of(t[0], stages) == stage]
        entries = []
        for name, dtype, shape, rules in mine:
            meta_full = torch.empty(shape, dtype=dtype, device="meta")
            for combo, piece in split_pieces(meta_full, rules, sizes):
                entries.append((piece_key("model", name, rules, combo, sizes), dtype, tuple(piece.shape)))

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, dtype, shape, rules in mine:
                full = produce(name).to(dtype)
                for combo, piece in split_pieces(full, rules, sizes):
                    yield piece_key("model", name, rules, combo, sizes), piece.contiguous()
                del full
                if progress is not None:
                    progress.update(1)

        prefix = f"model-pp{stage:02d}" if len(stages) > 1 else "model"
        weight_map.update(write_sharded(out, entries, stream(), shard_bytes, prefix=prefix))
        total += sum(nbytes(d, s) for _, d, s in entries)
    write_index(out, weight_map, total)
    (out / "meta.json").write_text(json.dumps({**meta, "format": FORMAT, "layout": sizes}, indent=2, sort_keys=True))


class ConvertedCheckpoint:
    """Reads a converted checkpoint tensor by tensor, at its own or any other layout."""

    def __init__(self, path: str | Path, meta: dict):
        self.path, self.meta = Path(path), meta
        self.files = read_weight_map(self.path)  # megamoe wrote it: no symlinks out, hub layout or not
        for shard in sorted(set(self.files.values())):
            member(self.path, shard, str(self.path / INDEX))
        self.sizes = meta["layout"]

    def read(self, key: str) -> torch.Tensor:
        if key not in self.files:
            raise CheckpointError(f"{self.path}: checkpoint lacks tensor {key}")
        return read_tensor(self.path / self.files[key], key)

    def full(self, name: str, rules) -> torch.Tensor:
        return assemble(self.read, "model", name, rules, self.sizes)

    def load_into(self, targets: list[tuple], groups: ParallelGroups) -> None:
        """targets: (tensor, name, rules); each rank reads its pieces or reassembles."""
        for dest, name, rules in targets:
            src = stored_rules(rules, "model", name, self.sizes, self.files.__contains__)
            if unchanged(rules, self.sizes, groups, src):
                piece = self.read(piece_key("model", name, rules, my_ranks(groups), self.sizes))
            else:
                piece = split_full(self.full(name, src), rules, groups)
            if tuple(piece.shape) != tuple(dest.shape):
                raise CheckpointError(f"{self.path}: tensor {name} has shape {list(piece.shape)}, "
                                      f"the model holds {list(dest.shape)}")
            with torch.no_grad():
                dest.copy_(piece)

    def names(self) -> list[str]:
        return sorted({k.split("/", 1)[1].split("#")[0] for k in self.files})


def tensor_bytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
