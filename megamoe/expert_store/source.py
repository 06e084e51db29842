"""Where tiered experts are read from: the safetensors files of a converted megamoe checkpoint.

A converted checkpoint (``megamoe-convert import-hf``, ``megamoe.expert_store.save_converted``) keeps
each MoE layer's experts stacked in slot order, whole or split over EP at import::

    model/<name>.gate_up_weight            [E, 2f, h]      (or #ep<r>of<n>: [E/n, 2f, h])
    model/<name>.down_weight               [E, h, f]       (or #ep<r>of<n>: [E/n, h, f])

so one expert's weights are contiguous byte ranges of one file. ``DiskSource`` reads exactly
those ranges with positioned reads into the destination tensors (the copy path: no file page
counts in the process's RSS, and a read costs the expert's bytes only), or, on a CPU, makes
views of the memory-mapped file that kernels read in place (``ExpertTensors.views``,
``megamoe.expert_store.mapped``: the pages mapped in are bounded by the budget).
Under expert-tensor parallelism (etp = q of Q) a rank reads its f-slice: two row ranges of
gate|up, and the down weight's [h, f] read whole and sliced (one expert at a time).

FP8 experts (an ``import-hf --keep-fp8`` checkpoint, ``megamoe.model.fp8_base``) are stored e4m3
with their block scales repeated over rows, ``<tensor>_scale`` [E, R, ceil(K / block)] float32:
an expert's rows are read as e4m3 bytes plus their rows of scales (about half of bf16's bytes)
and dequantised into the cache's slot in the model's dtype (``read_scaled``), exactly as the
resident FP8 base dequantises them per GEMM.

``HostSource`` reads this rank's experts once into host memory (pinned when the cache is on
a GPU) and serves copies: the ``host`` tier.

Every file problem is one line naming the file (``CheckpointError``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megamoe.checkpoint.hf_io import read_weight_map
from megamoe.checkpoint.safetensors_io import DTYPE_OF_CODE, header_and_start
from megamoe.core.errors import CheckpointError
from megamoe.core.untrusted import member
from megamoe.expert_store.mapped import MappedFile
from megamoe.layers.ops.fp8.frozen import dequantize_rows

E4M3 = torch.float8_e4m3fn

_INDEX = "model.safetensors.index.json"
_PIECE = re.compile(r"^ep(\d+)of(\d+)$")


@dataclass(frozen=True)
class _Entry:
    """One stored tensor: its file, dtype, shape and where its bytes start in the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int

    def expert_bytes(self) -> int:
        return self.shape[1] * self.shape[2] * self.dtype.itemsize


class DiskSource:
    """Reads experts' slices from a converted checkpoint directory (see the module docstring)."""

    def __init__(self, root: str | Path, files: dict[str, str] | None = None, prefix: str = "model/"):
        """``files``: {tensor: file} when known (an HF directory's, ``megamoe.expert_store.hf``), else
        the converted checkpoint's index; ``prefix``: what model tensor names carry in it."""
        self.root, self.prefix = Path(root), prefix
        self._headers: dict[str, tuple[dict, int]] = {}
        self._fds: dict[Path, int] = {}
        self.read_bytes = 0  # bytes read from the files so far (the copy path)
        self._maps: dict[Path, MappedFile] = {}
        if files is not None:
            self.files = files
            return
        index = self.root / _INDEX
        if not (index.exists() or index.is_symlink()):
            raise CheckpointError(f"{index}: missing: the expert store is a converted megamoe checkpoint "
                                  "(megamoe-convert import-hf)")
        self.files = read_weight_map(self.root)
        for shard in sorted(set(self.files.values())):  # regular files inside the checkpoint only
            member(self.root, shard, str(index))

    # ---- the index -------------------------------------------------------------------------

    def _entry(self, key: str) -> _Entry:
        name = self.files[key]
        if name not in self._headers:
            # every entry checked, every tensor's bytes inside the file: a truncated file fails here
            self._headers[name] = header_and_start(self.root / name)
        header, data = self._headers[name]
        info = header.get(key)
        if info is None or info.get("dtype") not in DTYPE_OF_CODE:
            raise CheckpointError(f"{self.root / name}: lacks tensor {key} (or its dtype is unknown)")
        return _Entry(self.root / name, DTYPE_OF_CODE[info["dtype"]], tuple(info["shape"]),
                      data + info["data_offsets"][0])

    def pieces(self, name: str, num_experts: int) -> list[tuple[int, _Entry]]:
        """[(first global expert, entry)] of a stacked expert tensor, whole or split over EP."""
        whole = f"{self.prefix}{name}"
        if whole in self.files:
            return [(0, self._checked(self._entry(whole), name, num_experts))]
        out = []
        for key in self.files:
            base, _, piece = key.partition("#")
            if base != whole:
                continue
            m = _PIECE.match(piece)
            if m is None:
                raise CheckpointError(f"{self.root}: tensor {name} is stored split as {piece!r}; the expert store "
                                      "reads whole or EP-split experts (import without --etp/--tp)")
            r, n = int(m.group(1)), int(m.group(2))
            out.append((r * num_experts // n, self._checked(self._entry(key), name, num_experts // n)))
        if not out:
            raise CheckpointError(f"{self.root}: the expert store lacks tensor {name}")
        return sorted(out, key=lambda p: p[0])

    def _checked(self, entry: _Entry, name: str, experts: int) -> _Entry:
        if len(entry.shape) != 3 or entry.shape[0] != experts:
            raise CheckpointError(f"{entry.file}: tensor {name} has shape {list(entry.shape)}, expected "
                                  f"{experts} stacked experts")
        return entry

    # ---- reads -----------------------------------------------------------------------------

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def read_into(self, entry: _Entry, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` from ``entry``'s bytes at element ``offset``,
        converting from the stored dtype."""
        buf = out if out.dtype == entry.dtype else torch.empty(out.shape, dtype=entry.dtype)
        view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
        pos, done = entry.start + offset * entry.dtype.itemsize, 0
        fd = self._fd(entry.file)
        while done < len(view):
            got = os.preadv(fd, [view[done:]], pos + done)
            if got <= 0:
                raise CheckpointError(f"{entry.file}: truncated (the expert store ended mid-tensor)")
            done += got
        self.read_bytes += done
        if buf is not out:
            out.copy_(buf)

    def view(self, entry: _Entry, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` over ``entry``'s bytes from element ``offset`` in the mapped
        file (``megamoe.expert_store.mapped``): nothing is read until it is touched."""
        if entry.file not in self._maps:
            self._maps[entry.file] = MappedFile(entry.file)
        return self._maps[entry.file].view(entry.start + offset * entry.dtype.itemsize, entry.dtype, shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._maps.clear()  # each mapping goes when the last view of it does


class ExpertTensors:
    """One tiered layer's two stacked tensors in a source, read one expert (this rank's
    f-slice of it) at a time.

    name: the experts module's full name (``layers.3.mlp.experts``); num_experts: E (global);
    f: the full ffn width; etp: (this rank's slice, slices); ``tensors``: the two stacked
    tensors' names in the source (default the converted checkpoint's ``<name>.gate_up_weight``,
    ``<name>.down_weight``); ``order``: the stored expert of each slot (an expert placement
    applied to a store in logical order, e.g. an HF checkpoint; None: the same); ``fp8_block``:
    the column block of e4m3 experts' scales (the model's ``fp8_base.block``; None: the model
    lists no FP8 experts, and e4m3 ones are refused)."""

    def __init__(self, source: DiskSource, name: str, num_experts: int, f: int, h: int, etp: tuple[int, int],
                 tensors: tuple[str, str] | None = None, order: list[int] | None = None,
                 fp8_block: int | None = None):
        self.source, self.name, self.f, self.h, self.order = source, name, f, h, order
        (self.q, self.etp), self.block = etp, fp8_block
        gate_up, down = tensors or (f"{name}.gate_up_weight", f"{name}.down_weight")
        self.gate_up = source.pieces(gate_up, num_experts)
        self.down = source.pieces(down, num_experts)
        self.scales = None  # (gate_up's, down's) scale pieces of FP8 experts
        for tensor, pieces, shape in ((gate_up, self.gate_up, (2 * f, h)), (down, self.down, (h, f))):
            for first, e in pieces:
                if e.shape[1:] != shape:
                    raise CheckpointError(f"{e.file}: {tensor} has shape {list(e.shape)}, the model "
                                          f"expects [{num_experts}, {shape[0]}, {shape[1]}]")
        if self.gate_up[0][1].dtype == E4M3 or self.down[0][1].dtype == E4M3:
            self.scales = tuple(self._scales(t, p, num_experts) for t, p in ((gate_up, self.gate_up), (down, self.down)))

    def _scales(self, tensor: str, pieces, num_experts: int) -> list:
        """The scale pieces of an e4m3 stack: ``<tensor>_scale`` [E, R, ceil(K / block)], split as the stack."""
        first_entry = pieces[0][1]
        if self.block is None or any(e.dtype != E4M3 for _, e in pieces):
            raise CheckpointError(f"{first_entry.file}: {tensor} is stored as {first_entry.dtype}, which the expert "
                                  "store reads only for experts the model's fp8_base lists (import-hf --keep-fp8)")
        scales = self.source.pieces(f"{tensor}_scale", num_experts)
        cols = -(-first_entry.shape[2] // self.block)
        for (at, e), (at_s, s) in zip(pieces, scales, strict=False):
            if len(scales) != len(pieces) or at != at_s or s.shape != (*e.shape[:2], cols):
                raise CheckpointError(f"{s.file}: {tensor}_scale has shape {list(s.shape)}, expected "
                                      f"[{e.shape[0]}, {e.shape[1]}, {cols}] (float32 block scales of {tensor})")
        return scales

    def _read_rows(self, which: int, expert: int, row: int, out: torch.Tensor) -> None:
        """Rows ``row`` .. of local stack ``which`` (0: gate_up, 1: down) of ``expert`` into
        ``out`` [rows, K]: read as stored, or e4m3 values and their scales dequantised."""
        pieces = (self.gate_up, self.down)[which]
        entry, local = self._find(pieces, expert)
        offset = local * entry.shape[1] + row  # in rows of the stack
        if self.scales is None:
            self.source.read_into(entry, offset * entry.shape[2], out)
            return
        scale, _ = self._find(self.scales[which], expert)
        rows = torch.empty(out.size(0), scale.shape[2], dtype=torch.float32)
        self.source.read_into(scale, offset * scale.shape[2], rows)
        read_scaled(self.source, entry, offset * entry.shape[2], rows, self.block, out)

    @staticmethod
    def _find(pieces, expert: int) -> tuple[_Entry, int]:
        for first, entry in reversed(pieces):
            if expert >= first:
                return entry, expert - first
        raise AssertionError(expert)

    def views(self, first: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | str:
        """W1 [n, 2f, h], W2 [n, h, f] of global experts ``first`` .. ``first + n`` as views of
        the mapped files (``megamoe.expert_store.mapped``), or why they cannot be."""
        if self.order is not None:
            return "an expert placement is applied at read time"
        if self.etp != 1:
            return "the experts are split over ETP"
        out = []
        for pieces, shape in ((self.gate_up, (2 * self.f, self.h)), (self.down, (self.h, self.f))):
            entry, local = self._find(pieces, first)
            if local + n > entry.shape[0]:
                return f"{entry.file.name}: the rank's experts span two EP pieces"
            if entry.dtype != dtype:
                return f"{entry.file.name}: stored as {entry.dtype}, the model runs in {dtype}"
            if entry.start % dtype.itemsize:
                return f"{entry.file.name}: its tensor data starts unaligned for {dtype}"
            out.append(self.source.view(entry, local * shape[0] * shape[1], (n, *shape)))
        return tuple(out)

    def read(self, expert: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Global ``expert``'s slices into w1 [2f/etp, h] and w2 [h, f/etp] (contiguous, CPU)."""
        f, h, fl = self.f, self.h, self.f // self.etp
        expert = expert if self.order is None else self.order[expert]
        for part, rows in enumerate((slice(0, fl), slice(fl, 2 * fl))):  # gate, then up
            self._read_rows(0, expert, part * f + self.q * fl, w1[rows])
        if self.etp == 1:
            self._read_rows(1, expert, 0, w2)
        else:  # [h, f] rows are strided in the f-slice: read the expert's whole down weight once
            whole = torch.empty(h, f, dtype=w2.dtype)
            self._read_rows(1, expert, 0, whole)
            w2.copy_(whole[:, self.q * fl:(self.q + 1) * fl])


def read_scaled(source: DiskSource, entry: _Entry, offset: int, scale_rows: torch.Tensor, block: int,
                out: torch.Tensor) -> None:
    """``out`` [n, K] (float) = e4m3 ``entry``'s n rows of K from element ``offset``, times
    ``scale_rows`` [n, C] (float32: each row's scale per ``block`` columns). The values are
    ``dequantize_rows``'s, as the resident FP8 base computes them per GEMM."""
    n, k = out.shape
    q = torch.empty(n, k, dtype=E4M3)
    source.read_into(entry, offset, q)
    out.copy_(dequantize_rows(q, scale_rows, torch.arange(k) // block, out.dtype))


class HostSource:
    """The ``host`` tier: a layer's local experts read once into host memory (``pin``: pinned,
    for asynchronous copies to a GPU); ``read`` copies one expert out."""

    def __init__(self, tensors: ExpertTensors, experts: range, shapes, dtype: torch.dtype, pin: bool):
        s1, s2 = shapes
        self.first = experts.start
        self.w1 = torch.empty(len(experts), *s1, dtype=dtype, pin_memory=pin)
        self.w2 = torch.empty(len(experts), *s2, dtype=dtype, pin_memory=pin)
        for i, e in enumerate(experts):
            tensors.read(e, self.w1[i], self.w2[i])

    def read(self, expert: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
        w1.copy_(self.w1[expert - self.first])
        w2.copy_(self.w2[expert - self.first])
