"""One run per folder: an OS file lock (``fcntl.flock``) on ``FOLDER/.megamoe.lock``, held for the
run and released by the OS when the process exits or dies (no stale lock survives a crash).

The lock file records the holder (pid, host) so a second run is refused in one line naming it;
it is removed when the holder releases the lock. flock works on local file systems and on NFS
(Linux emulates it with POSIX locks there).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from megamoe.core.errors import ConfigError

LOCK_NAME = ".megamoe.lock"


def holder_of(lock_file: Path) -> str:
    """'pid P on HOST' as the holder wrote it (or 'an unknown process' while it is being written)."""
    try:
        info = json.loads(lock_file.read_text())
        return f"pid {int(info['pid'])} on {str(info['host'])[:100]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process"


class FolderLock:
    """``with FolderLock(folder, "checkpoint.dir"):`` hold ``folder`` for this process (the folder is
    created if need be); a second holder is refused with a ``ConfigError`` naming the first."""

    def __init__(self, folder: str | Path, what: str):
        self.folder, self.what = Path(folder), what
        self.file = self.folder / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(f"{self.what}={self.folder}: in use by another run ({holder_of(self.file)}); one "
                                  f"run per folder at a time: wait for it, stop it, or choose another folder") from None
            try:  # the previous holder may have removed the file between our open and flock: lock the new one
                same = os.fstat(fd).st_ino == os.stat(self.file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.file.unlink(missing_ok=True)  # while still held: nobody else holds this inode
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> bool:
        self.release()
        return False
