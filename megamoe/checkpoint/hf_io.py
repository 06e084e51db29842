"""HF checkpoint directories: read config.json and safetensors shards one tensor at a time,
write shards + index + config atomically."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megamoe.checkpoint.safetensors_io import StreamWriter, nbytes, read_header, read_tensor
from megamoe.core.errors import CheckpointError
from megamoe.core.files import AtomicDir
from megamoe.core.untrusted import json_object, member

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"


def read_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    if file.exists():
        member(path, "config.json", str(path), hub=True)  # a regular file of the folder's
    return json_object(file, missing="not found (an HF checkpoint directory has a config.json)")


class HFCheckpoint:
    """Tensor names, shapes and dtypes of an HF directory from the shard headers alone."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = read_config(self.path)
        self.files = self._shard_map()
        self.scales: dict[str, str] = {}  # quantised tensor -> its scale: none as stored (megamoe.convert.quant)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in sorted(set(self.files.values())):
            for name, info in read_header(self.path / file).items():
                if self.files.get(name) == file:
                    self.shapes[name] = tuple(info["shape"])
                    self.dtypes[name] = info["dtype"]
        listed = [n for n in self.files if n not in self.shapes]
        if listed:
            raise CheckpointError(f"{self.path / INDEX}: lists {listed[0]} in {self.files[listed[0]]}, "
                                  f"which does not contain it")

    def _shard_map(self) -> dict[str, str]:
        """tensor name -> shard file, each shard checked to be a regular file of the folder
        (``megamoe.core.untrusted.member``: the hub cache's blob symlinks allowed)."""
        index = self.path / INDEX
        if index.exists() or index.is_symlink():
            weight_map = read_weight_map(self.path, hub=True)
            for shard in sorted(set(weight_map.values())):
                member(self.path, shard, str(index), hub=True)
            return weight_map
        shards = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.path}: no *.safetensors weights found")
        out = {}
        for shard in shards:
            for name in read_header(member(self.path, shard, str(self.path), hub=True)):
                out[name] = shard
        return out

    @property
    def names(self) -> set[str]:
        return set(self.shapes)

    def tensor(self, name: str) -> torch.Tensor:
        return read_tensor(self.path / self.files[name], name)

    def largest_bytes(self) -> int:
        from megamoe.checkpoint.safetensors_io import DTYPE_CODES

        sizes = {v: torch.empty((), dtype=k).element_size() for k, v in DTYPE_CODES.items()}
        return max((sizes.get(self.dtypes[n], 8) * max(1, _prod(s)) for n, s in self.shapes.items()), default=0)


def read_weight_map(folder: Path, hub: bool = False) -> dict[str, str]:
    """The ``weight_map`` of ``folder``'s safetensors index: tensor name -> shard file name (the
    shards themselves are checked by the caller with ``member``)."""
    index = member(folder, INDEX, str(folder), hub=hub)
    weight_map = json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, not an object of "
                              f"tensor name -> shard file")
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise CheckpointError(f"{index}: weight_map[{bad!r}] is {weight_map[bad]!r}, not a shard file name")
    return weight_map


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def plan_shards(entries: list[tuple[str, torch.dtype, tuple]], shard_bytes: int) -> list[list[tuple]]:
    shards, current, size = [], [], 0
    for entry in entries:
        n = nbytes(entry[1], entry[2])
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += n
    if current:
        shards.append(current)
    return shards


def write_sharded(out: Path, entries: list[tuple[str, torch.dtype, tuple]], tensors: Iterator[tuple[str, torch.Tensor]],
                  shard_bytes: int, prefix: str = "model", metadata: dict | None = None) -> dict[str, str]:
    """Stream ``tensors`` (in ``entries`` order) into size-limited shards; returns the weight map."""
    shards = plan_shards(entries, shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"{prefix}.safetensors" if len(shards) == 1 else f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = StreamWriter(out / name, shard, metadata)
        try:
            for entry in shard:
                tname, tensor = next(tensors)
                writer.write(tname, tensor)
                weight_map[tname] = name
        finally:
            writer.abort() if writer.next != len(shard) else writer.close()
    return weight_map


def write_index(out: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total_bytes},
                                         "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def write_hf_dir(out_dir: str | Path, config: dict, entries: list[tuple[str, torch.dtype, tuple]],
                 tensors: Iterable[tuple[str, torch.Tensor]], shard_bytes: int = 5 << 30,
                 overwrite: bool = False, extra_files: dict[str, str] | None = None, inputs=()) -> Path:
    """An HF checkpoint directory, written atomically, tensors streamed in ``entries`` order;
    ``inputs``: (name, path) it is written from, which it must stay apart from."""
    with AtomicDir(out_dir, overwrite, inputs=inputs) as tmp:
        weight_map = write_sharded(tmp, entries, iter(tensors), shard_bytes, metadata={"format": "pt"})
        write_index(tmp, weight_map, sum(nbytes(d, s) for _, d, s in entries))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(out_dir)
