"""Reading ``torch.distributed.checkpoint`` (DCP) folders without executing anything from them.

DCP's ``.metadata`` is a pickle, and its default load planner reads any entry recorded as
``BytesStorageMetadata`` with ``torch.load(weights_only=False)``: a crafted checkpoint
would run code on load. megamoe checkpoints hold tensors only, so here

- the metadata is unpickled with an allow-list of the plain classes DCP metadata is made
  of (anything else, e.g. ``os.system``, is refused while unpickling);
- every entry must then be a tensor, stored in a plain ``*.distcp`` file of the folder, with
  no storage transforms; a bytes entry is refused naming the checkpoint and the key;
- the load planner refuses byte reads as well (a second lock on the same door);
- DCP's ``CheckpointException`` (a ``BaseException``, so ``except Exception`` misses it)
  becomes one ``CheckpointError`` line: the first failing rank's own message.

Tensor payloads are read by DCP with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from megamoe.core.errors import CheckpointError
from megamoe.core.untrusted import member

_DCP = "torch.distributed.checkpoint.metadata"
# the classes a DCP metadata file of tensors is made of (torch 2.4-2.14); BytesStorageMetadata is
# let through the unpickler only so that the entry using it can be named in the error below
_ALLOWED = {(_DCP, n) for n in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                "_MEM_FORMAT_ENCODING", "StorageMeta", "MetadataIndex", "BytesStorageMetadata")}
_ALLOWED |= {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
             ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
             ("pathlib", "PurePosixPath"), ("builtins", "set"), ("builtins", "frozenset")}


class _SafeUnpickler(pickle.Unpickler):
    """Only the allow-listed classes and torch dtypes; anything else is refused."""

    def __init__(self, data: bytes, path: Path):
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.path}: checkpoint metadata refers to {module}.{name}, "
                              "which a checkpoint may not contain")


def _check_entries(path: Path, md) -> None:
    """Tensors only, each stored in a ``.distcp`` file directly inside the checkpoint folder."""
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: .metadata is not DCP checkpoint metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{path}: key {key} is stored as {type(entry).__name__}, not a tensor "
                                  "(megamoe checkpoints hold tensors only; refusing to unpickle it)")
        if not isinstance(getattr(entry.properties, "dtype", None), torch.dtype):
            raise CheckpointError(f"{path}: key {key} has no tensor dtype")
    for index, info in (md.storage_data or {}).items():
        key = getattr(index, "fqn", index)
        rel = getattr(info, "relative_path", None)
        if not (isinstance(rel, str) and rel.endswith(".distcp") and "/" not in rel and "\\" not in rel):
            raise CheckpointError(f"{path}: key {key} points outside the checkpoint's .distcp files ({rel!r})")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path}: key {key} is stored with transforms {info.transform_descriptors}, "
                                  "which megamoe checkpoints do not use")


def read_safe_metadata(path: Path) -> Metadata:
    """The folder's DCP metadata, unpickled through the allow-list and checked entry by entry;
    it and every file it names are regular files inside the folder (no symlink leads out)."""
    file = path / ".metadata"
    if file.exists() or file.is_symlink():
        member(path, ".metadata", str(path))
    try:
        data = file.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read checkpoint metadata ({e.strerror})") from None
    try:
        md = _SafeUnpickler(data, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  (truncated or corrupted file)
        raise CheckpointError(f"{file}: corrupted checkpoint metadata ({type(e).__name__})") from None
    _check_entries(path, md)
    for rel in sorted({info.relative_path for info in (md.storage_data or {}).values()}):
        member(path, rel, f"{path}/.metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        metadata = read_safe_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner, minus byte entries (which it would ``torch.load`` unrestricted)."""

    def load_bytes(self, read_item, value):
        raise CheckpointError(f"checkpoint key {read_item.dest_index.fqn} is a byte entry; refusing to unpickle it")


def first_failure(e: CheckpointException) -> BaseException:
    """The exception of the lowest failing rank inside DCP's wrapper."""
    failures = e.failures or {}
    for rank in sorted(failures):
        item = failures[rank]
        return item[0] if isinstance(item, tuple) else item
    return e


def checkpoint_error(path: Path, action: str, e: BaseException) -> CheckpointError:
    """One line for a DCP failure: megamoe's own error as it is, else the first line of the cause.
    An interruption (SIGTERM, Ctrl-C: a KeyboardInterrupt that DCP wrapped) is raised again as
    itself, so the command stops as interrupted, not as a failed save."""
    cause = first_failure(e) if isinstance(e, CheckpointException) else e
    interrupt = cause
    while interrupt is not None and not isinstance(interrupt, KeyboardInterrupt):
        interrupt = interrupt.__context__  # torch.save's writer fails again when a signal cuts it off
    if interrupt is not None:
        raise interrupt
    if isinstance(cause, CheckpointError):
        return cause
    text = str(cause).strip()
    first = text.splitlines()[0] if text else "truncated or corrupted file"
    return CheckpointError(f"{path}: cannot {action} checkpoint ({type(cause).__name__}: {first[:300]})")


@contextlib.contextmanager
def quiet():
    """DCP warns on every single-process call that it assumes a single process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_load(path: Path, request: dict, no_dist: bool) -> None:
    """``dcp.load`` into ``request`` in place through the safe reader and planner; one-line errors."""
    import torch.distributed.checkpoint as dcp

    try:
        with quiet():
            dcp.load(request, storage_reader=SafeFileSystemReader(str(path)), planner=TensorsOnlyPlanner(),
                     no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (CheckpointException is a BaseException)
        raise checkpoint_error(path, "load", e) from None
