"""Streaming safetensors I/O: write tensors one at a time, read one tensor at a time.

The safetensors library writes a whole dict at once; conversion must hold only the tensor
at hand, so the writer lays out the header from the planned (name, dtype, shape) entries
first and then appends each tensor's bytes in that order. Files are read back with the
safetensors library, one tensor at a time.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from megamoe.core.errors import CheckpointError

DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
DTYPE_OF_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}
# dtypes safetensors stores that megamoe does not convert (refused by name later, not as a broken header)
OTHER_CODES = ("U16", "U32", "U64", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64")


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class StreamWriter:
    """Writes one safetensors file whose entries are known in advance, tensor by tensor."""

    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.order = [name for name, _, _ in entries]
        self.expect = {name: (dtype, tuple(shape)) for name, dtype, shape in entries}
        header, offset = {}, 0
        for name, dtype, shape in entries:
            size = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        if metadata:
            header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.next >= len(self.order) or self.order[self.next] != name:
            want = self.order[self.next] if self.next < len(self.order) else "nothing"
            raise RuntimeError(f"{self.path.name}: wrote {name}, expected {want}")
        dtype, shape = self.expect[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor {name} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}")
        data = tensor.detach().contiguous().cpu()
        if data.numel():  # the tensor's own buffer, no bytes copy
            self.file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            raise RuntimeError(f"{self.path.name}: {len(self.order) - self.next} tensors were not written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def abort(self) -> None:
        self.file.close()


MAX_HEADER = 100_000_000  # bytes: the safetensors library's own limit


def read_header(path: str | Path) -> dict:
    """The safetensors header of ``path`` (names -> dtype, shape, offsets), every entry checked
    (``check_entry``) and against the file size, so a hostile or truncated shard is one line
    before any tensor is read. ``path`` must be a regular file (``megamoe.core.untrusted.member``)."""
    return header_and_start(path)[0]


def header_and_start(path: str | Path) -> tuple[dict, int]:
    """(``read_header(path)``, the offset where the tensors' bytes start)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a header")
            n = struct.unpack("<Q", head)[0]
            if n > min(size - 8, MAX_HEADER):
                raise ValueError(f"header of {n} bytes runs past the end of the file or the {MAX_HEADER} allowed")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not a valid safetensors file (header nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a valid safetensors file (header is a JSON {type(header).__name__}, "
                              f"not an object)")
    header.pop("__metadata__", None)
    end = max((check_entry(path, name, v) for name, v in header.items()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated ({size} bytes, header needs {8 + n + end})")
    return header, 8 + n


def check_entry(path: Path, name: str, entry) -> int:
    """One header entry is {dtype: a known code, shape: ints >= 0, data_offsets: [begin, end]} whose
    byte count fits dtype and shape; returns its end offset."""
    def bad(why: str):
        return CheckpointError(f"{path}: header entry {name[:200]!r} {why}")

    if not isinstance(entry, dict):
        raise bad(f"is a JSON {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_OF_CODE and dtype not in OTHER_CODES:
        raise bad(f"has dtype {str(dtype)[:40]!r}, not a safetensors dtype")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise bad(f"has shape {str(shape)[:80]}, not a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {str(offsets)[:80]}, not [begin, end] with 0 <= begin <= end")
    if dtype in DTYPE_OF_CODE and offsets[1] - offsets[0] != nbytes(DTYPE_OF_CODE[dtype], shape):
        raise bad(f"holds {offsets[1] - offsets[0]} bytes, its dtype and shape need {nbytes(DTYPE_OF_CODE[dtype], shape)}")
    return offsets[1]


def read_tensor(path: str | Path, name: str) -> torch.Tensor:
    """One tensor backed by a private mapping of the file: pages load as they are read and the
    mapping goes away with the tensor, so memory follows the tensors alive, not the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise CheckpointError(f"{path}: cannot read tensor {name} ({str(e).splitlines()[0][:200]})") from None
