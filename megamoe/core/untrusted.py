"""Reading what a checkpoint (or any folder handed to megamoe) says, as untrusted input:

- ``member``: a file a folder names (an index's shard, a DCP file, a glob's match) must be a plain
  relative name that resolves, symlinks followed, to a regular file inside the folder: never an
  absolute path, ``..``, a symlink leading out, a FIFO (reading it would block forever) or a
  device (``/dev/zero`` never ends). One exception, for HF folders only: the Hugging Face hub
  cache's snapshot layout, whose files are symlinks into the model's own ``blobs`` folder.
- ``read_json``: a JSON file, bounded before it is parsed (a regular file of at most
  ``MAX_JSON_BYTES``) and while (``megamoe.core.json_limits``: nesting, surrogates); every
  failure one line.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from megamoe.core.errors import CheckpointError, MegamoeError
from megamoe.core.json_limits import JsonLimitError, loads_bounded

MAX_JSON_BYTES = 256 << 20  # an index of a trillion-parameter release is ~10 MB


def _hub_blob(folder: Path, real: Path) -> bool:
    """``folder`` is a hub snapshot (``<repo>/snapshots/<rev>``) and ``real`` is in ``<repo>/blobs``."""
    return folder.parent.name == "snapshots" and real.parent == folder.parent.parent / "blobs"


def member(folder: str | Path, name, what: str, hub: bool = False, error=CheckpointError) -> Path:
    """``folder/name`` once checked: ``name`` a relative path without ``..`` that resolves to a regular
    file inside ``folder`` (``hub``: or in the hub cache's blobs, see above). ``what`` names who
    names it (the index file, the metadata) in the error."""
    folder = Path(folder)
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or name.startswith("/") or "\\" in name or ".." in parts or "\x00" in name:
        raise error(f"{what}: entry {name!r} is not a file name inside {folder}")
    path = folder / name
    real, base = path.resolve(), folder.resolve()
    if not (real.is_relative_to(base) or (hub and _hub_blob(base, real))):
        raise error(f"{what}: {name} leads outside {folder} (to {real}); a checkpoint names only its own files")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise error(f"{path}: file not found (named by {what})") from None
    if not stat.S_ISREG(mode):
        raise error(f"{what}: {name} is not a regular file (a FIFO, device or folder); refusing to read it")
    return path


def read_json(path: str | Path, error: type[MegamoeError] = CheckpointError, max_bytes: int = MAX_JSON_BYTES,
              missing: str = "not found"):
    """The JSON value in ``path``: a regular file of at most ``max_bytes``, parsed by
    ``megamoe.core.json_limits.loads_bounded`` (nesting, surrogates); one-line errors naming it."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file (a FIFO, device or folder); refusing to read it")
    if st.st_size > max_bytes:
        raise error(f"{path}: {st.st_size:,} bytes, more than the {max_bytes:,} a JSON file here may have")
    try:
        return loads_bounded(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except JsonLimitError as e:
        raise error(f"{path}: {e}") from None


def json_object(path: str | Path, error: type[MegamoeError] = CheckpointError, **kwargs) -> dict:
    """``read_json`` of a file that must hold an object."""
    data = read_json(path, error, **kwargs)
    if not isinstance(data, dict):
        raise error(f"{path}: a JSON {type(data).__name__}, expected an object")
    return data
