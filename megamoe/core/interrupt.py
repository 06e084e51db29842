"""SIGTERM (how schedulers stop jobs) and SIGINT (Ctrl-C) handled alike: the signal becomes an
``Interrupted`` exception in the main thread, so every ``with``/``finally`` on the way out runs
(partial outputs are removed, ``latest`` stays on the last complete checkpoint), and the command
ends with one line naming what was interrupted and what it left (``megamoe.commands.cli``).

A second signal while that clean-up runs is ignored: the clean-up is what makes the stop safe.
What is in progress is declared with ``doing(what, left)``; the innermost one names the
interruption.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Task:
    """What is in progress, and what an interruption of it leaves (a text, or a function giving one
    once the clean-up has run)."""

    what: str
    left: str | Callable[[], str] = ""

    def outcome(self) -> str:
        try:
            return self.left() if callable(self.left) else self.left
        except Exception:  # noqa: BLE001  (the message must not fail the exit)
            return ""


class Interrupted(KeyboardInterrupt):
    """A SIGTERM or SIGINT, raised in the main thread (a KeyboardInterrupt, so code that already
    handles Ctrl-C handles it too). ``task``: the innermost ``doing`` when the signal came."""

    def __init__(self, signum: int, task: Task | None):
        self.signum, self.task = signum, task
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT

    def message(self) -> str:
        name = signal.Signals(self.signum).name
        if self.task is None:
            return f"interrupted by {name}"
        left = self.task.outcome()
        return f"interrupted by {name} while {self.task.what}" + (f"; {left}" if left else "")


_tasks: list[Task] = []
_stopping = False


@contextlib.contextmanager
def doing(what: str, left: str | Callable[[], str] = ""):
    """Declare ``what`` is in progress (``left``: what an interruption of it leaves)."""
    task = Task(what, left)
    _tasks.append(task)
    try:
        yield task
    finally:
        _tasks.remove(task)


def _raise(signum, frame):
    global _stopping
    if _stopping:
        return  # already stopping: let the clean-up finish
    _stopping = True
    raise Interrupted(signum, _tasks[-1] if _tasks else None)


@contextlib.contextmanager
def signals_raise():
    """Within the block, SIGTERM and SIGINT raise ``Interrupted`` (main thread only; elsewhere the
    handlers cannot be set and nothing changes)."""
    global _stopping
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in SIGNALS}
    _stopping = False
    for s in SIGNALS:
        signal.signal(s, _raise)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
