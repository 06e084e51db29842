"""Output folders: written under a temporary name and renamed when complete, and replaced
(``overwrite``) only when they hold what megamoe or an HF checkpoint writes; never the input,
inside it or holding it. megamoe never deletes a folder or file it did not write: a temporary
folder carries a marker (``PARTIAL``) so that one an interrupted run left behind is recognised
and removed by the next run, and nothing unmarked is."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterable

from megamoe.core.errors import CheckpointError, MegamoeError
from megamoe.core.interrupt import doing

log = logging.getLogger(__name__)

PARTIAL = ".megamoe-partial"  # marks a folder megamoe is still writing (a partial output)


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


def overlap(a: str | Path, b: str | Path) -> str | None:
    """How path ``a`` stands to ``b`` once both are resolved (symlinks followed): "is", "is inside",
    "holds", or None when they are apart."""
    ra, rb = Path(a).resolve(), Path(b).resolve()
    if ra == rb:
        return "is"
    return "is inside" if ra.is_relative_to(rb) else "holds" if rb.is_relative_to(ra) else None


def check_apart(out: str | Path, inputs: Iterable[tuple[str, str | Path]], error=CheckpointError,
                label: str | None = None) -> None:
    """Raise unless the output ``out`` is apart from every input (``(name, path)``): never the
    input, inside it or holding it, whatever ``--overwrite`` says (replacing or writing into an
    input destroys what is being read)."""
    for name, path in inputs:
        relation = overlap(out, path)
        if relation is not None:
            raise error(f"{label or out}: the output {relation} the input {name} {path}; an output is never its "
                        f"input, inside it or holding it (choose another output path)")


def check_replaceable(out: Path, overwrite: bool, ours, what: str, error=CheckpointError,
                      inputs: Iterable[tuple[str, str | Path]] = ()) -> None:
    """Raise unless ``out`` may be written: it is apart from ``inputs`` (``check_apart``), and it
    does not exist, or ``overwrite`` is set and ``ours(out)`` says megamoe (or an HF checkpoint) wrote it."""
    check_apart(out, inputs, error)
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise error(f"{out}: already exists (pass --overwrite / overwrite=True to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise error(f"{out}: exists and is not a folder; --overwrite only replaces a {what} folder")
    if not ours(out):
        raise error(f"{out}: exists and does not look like a {what} (none of its marker files); "
                    f"--overwrite only replaces what megamoe wrote, so remove it yourself or choose another path")


def mark_partial(folder: Path) -> Path:
    """Mark ``folder`` as a partial output of this process (``PARTIAL``: pid and host), so that a
    later run may remove it if this one dies before finishing; returns ``folder``."""
    (folder / PARTIAL).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    return folder


def is_stale_partial(folder: Path) -> bool:
    """``folder`` holds megamoe's partial-output marker and its writer is gone (a process of this
    host that no longer runs). A folder without the marker is never megamoe's to remove."""
    try:
        info = json.loads((folder / PARTIAL).read_text())
        pid, host = int(info["pid"]), str(info["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname():
        return False  # another machine's run may still be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return pid == os.getpid()  # our own earlier attempt (e.g. in a long-lived process)


def remove_stale_partials(parent: Path, pattern: str) -> list[Path]:
    """Remove the folders matching ``pattern`` in ``parent`` that are stale partial outputs
    (``is_stale_partial``): what earlier interrupted runs left behind. Returns them."""
    gone = [p for p in parent.glob(pattern) if p.is_dir() and not p.is_symlink() and is_stale_partial(p)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
        log.info("removed %s, left behind by an interrupted run", p)
    return gone


def temp_dir_beside(out: Path) -> Path:
    """A new, uniquely named hidden folder next to ``out`` (same file system, so the final rename
    is atomic; unique, so it never clashes with a user's folder), marked as a partial output;
    those that earlier interrupted runs left for the same ``out`` are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out.parent, f".{out.name}.tmp-*")
    remove_stale_partials(out.parent, f".{out.name}.old-*")
    return mark_partial(Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)))


def replace_dir(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (checked with ``check_replaceable``) is
    moved aside first and removed only after the new one is in place."""
    (tmp / PARTIAL).unlink(missing_ok=True)
    old = None
    if out.exists():
        old = mark_partial(Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent)))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class AtomicDir:
    """``with AtomicDir(out, overwrite) as tmp:`` write into ``tmp``; on success it becomes
    ``out``, on any error it is removed. An existing ``out`` is replaced only when ``ours(out)``
    (default: a checkpoint folder, ``is_checkpoint_dir``)."""

    def __init__(self, out: str | Path, overwrite: bool = False, ours=is_checkpoint_dir,
                 what: str = "checkpoint", error: type[MegamoeError] = CheckpointError,
                 inputs: Iterable[tuple[str, str | Path]] = ()):
        self.out = Path(out)
        check_replaceable(self.out, overwrite, ours, what, error, inputs)

    def __enter__(self) -> Path:
        self.task = contextlib.ExitStack()
        self.task.enter_context(doing(f"writing {self.out}", written_or_kept(self.out)))
        self.tmp = temp_dir_beside(self.out)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        with self.task:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            try:
                replace_dir(self.tmp, self.out)
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
        return False


def written_or_kept(out: Path) -> str:
    """What an interrupted write of ``out`` leaves (its partial copy is removed on the way out)."""
    if out.exists():
        return f"{out} is as it was (the partial new copy was removed)"
    return f"{out} was not written (the partial copy was removed)"
