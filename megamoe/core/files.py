"""Output folders: written under a temporary name and renamed when complete, and replaced
(``overwrite``) only when they hold what megamoe or an HF checkpoint writes. megamoe never
deletes a folder or file it did not write."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from megamoe.core.errors import CheckpointError, MegamoeError


def is_checkpoint_dir(path: Path) -> bool:
    """A megamoe checkpoint (meta.json), a run's checkpoint folder (latest.json), a PEFT adapter
    (adapter_config.json) or an HF checkpoint (config.json beside its weights)."""
    if (path / "meta.json").is_file() or (path / "latest.json").is_file() or (path / "adapter_config.json").is_file():
        return True
    weights = (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
               or (path / "model.safetensors.index.json").is_file())
    return (path / "config.json").is_file() and weights


def has_header(path: Path, name: str, fmt: str) -> bool:
    """``path/name`` is a JSON object whose "format" is ``fmt`` (e.g. a token directory's header)."""
    try:
        return json.loads((path / name).read_text()).get("format") == fmt
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(out: Path, overwrite: bool, ours, what: str, error=CheckpointError) -> None:
    """Raise unless ``out`` may be written: it does not exist, or ``overwrite`` is set and
    ``ours(out)`` says megamoe (or an HF checkpoint) wrote it."""
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise error(f"{out}: already exists (pass --overwrite / overwrite=True to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise error(f"{out}: exists and is not a folder; --overwrite only replaces a {what} folder")
    if not ours(out):
        raise error(f"{out}: exists and does not look like a {what} (none of its marker files); "
                    f"--overwrite only replaces what megamoe wrote, so remove it yourself or choose another path")


def temp_dir_beside(out: Path) -> Path:
    """A new, uniquely named hidden folder next to ``out`` (same file system, so the final rename
    is atomic; unique, so it never clashes with a user's folder)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (checked with ``check_replaceable``) is
    moved aside first and removed only after the new one is in place."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class AtomicDir:
    """``with AtomicDir(out, overwrite) as tmp:`` write into ``tmp``; on success it becomes
    ``out``, on any error it is removed. An existing ``out`` is replaced only when ``ours(out)``
    (default: a checkpoint folder, ``is_checkpoint_dir``)."""

    def __init__(self, out: str | Path, overwrite: bool = False, ours=is_checkpoint_dir,
                 what: str = "checkpoint", error: type[MegamoeError] = CheckpointError):
        self.out = Path(out)
        check_replaceable(self.out, overwrite, ours, what, error)

    def __enter__(self) -> Path:
        self.tmp = temp_dir_beside(self.out)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        try:
            replace_dir(self.tmp, self.out)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return False
