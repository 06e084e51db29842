"""The folders a training run writes (``checkpoint.dir``, the log folder) and what it holds on them:

- one run per ``checkpoint.dir``: rank 0 holds its lock (``megamoe.core.folder_lock``) for the run;
- partial saves (``step_X.tmp`` with megamoe's marker) that an interrupted or killed run left are
  removed when the next run takes the folder, and this run's own on any failure or interruption,
  so ``latest`` always names the last complete checkpoint;
- a run that fails (or is interrupted) before its first step leaves nothing behind: the folders
  it created are removed again; folders that existed before are left as they were, apart from
  what the run itself added to them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable

from megamoe.checkpoint.dcp import latest_checkpoint, remove_partial_saves
from megamoe.core.files import remove_stale_partials
from megamoe.core.folder_lock import FolderLock
from megamoe.core.interrupt import doing


def missing_from(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet (the folders ``mkdir(parents=True)`` creates),
    deepest first."""
    out = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        out.append(p)
    return out


class RunFolders:
    """``with RunFolders(checkpoint_dir, log_dir, holder) as run:`` around a training run (``holder``:
    this process is the one that writes, global rank 0). ``run.trained`` is set to a function that
    says whether a step completed; until it does, a failure removes the folders the run created."""

    def __init__(self, checkpoint_dir: str | None, log_dir: str | Path, holder: bool):
        self.dirs = [Path(d) for d in (checkpoint_dir, log_dir) if d]
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.holder = holder
        self.created = {p for d in self.dirs for p in missing_from(d.absolute())}
        self.lock = FolderLock(self.checkpoint_dir, "checkpoint.dir") if holder and checkpoint_dir else None
        self.trained: Callable[[], bool] = lambda: False
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> RunFolders:
        if self.lock is not None:
            self.lock.acquire()
            self.stack.callback(self.lock.release)
            remove_stale_partials(self.checkpoint_dir, "step_*.tmp")
            remove_stale_partials(self.checkpoint_dir, "step_*.replaced")
        where = f"training (checkpoint.dir={self.checkpoint_dir})" if self.checkpoint_dir else "training"
        self.stack.enter_context(doing(where, self.left))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is not None and self.holder:
                self._clean_up()
        finally:
            self.stack.close()
        return False

    def _clean_up(self) -> None:
        if self.checkpoint_dir is not None and self.checkpoint_dir.is_dir():
            remove_partial_saves(self.checkpoint_dir)  # this run's own (its lock keeps others out)
        if self.trained():
            return
        if self.lock is not None:
            self.lock.release()
        for d in self.dirs:
            if d.absolute() in self.created:
                shutil.rmtree(d, ignore_errors=True)
        for p in sorted(self.created, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(p)  # an ancestor the run created, if nothing else is in it now

    def left(self) -> str:
        """What an interruption leaves: the checkpoint ``latest`` names (after the clean-up)."""
        if self.checkpoint_dir is None:
            return "no checkpoints (no checkpoint.dir)"
        latest = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir.is_dir() else None
        return f"{latest.name} stays latest" if latest else "no checkpoint was written"
