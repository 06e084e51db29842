"""Count the host synchronisations of a piece of work (a training step, a forward).

A host synchronisation is a point where the host waits for the device to finish what it
queued: reading a tensor's values into Python (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool/int/float(tensor)``), an op whose output shape depends on tensor values
(``nonzero``, ``masked_select``, boolean indexing, ``unique``, ``repeat_interleave`` without
``output_size``), and the host-side collectives (``barrier``, the ``*_object`` collectives).
On CPU none of these waits for anything, but each is a stall on an accelerator, so counting
them on CPU tells what a GPU step would pay.

``HostSyncCounter`` spies on those entry points while active; each event is noted with the
communication tag in force (``megamoe.parallel.comm.tag_scope``: ``layer3``, ``grad_sync``, ...)
and the first caller outside torch (``layers/mlp/dispatch.py:140``), so a test can say which
layer's code synchronised. Events inside other counted events (torch's own ``.tolist()`` of a
``.cpu()``) count once.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megamoe.parallel import comm

_TENSOR_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
_HOST_COLLECTIVES = ("barrier", "all_gather_object", "broadcast_object_list", "gather_object",
                     "scatter_object_list")
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


@dataclass(frozen=True)
class SyncEvent:
    kind: str  # "tolist", "nonzero", "barrier", ...
    tag: str  # the communication tag in force (a layer's "layer3", the trainer's "grad_sync", ...)
    where: str  # "path/to/file.py:line" of the first caller outside torch and this module


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path != _HERE:
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _data_dependent(func, args, kwargs) -> bool:
    """Whether the aten op ``func`` sizes its output from tensor values."""
    name = func.overloadpacket.__name__
    if name in ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "nonzero_static"):
        return name != "nonzero_static"
    if name == "repeat_interleave" and isinstance(args[0] if args else None, torch.Tensor):
        return kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None)
    if name == "index" and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


class _ShapeSpy(TorchDispatchMode):
    def __init__(self, note):
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _data_dependent(func, args, kwargs):
            self.note(func.overloadpacket.__name__)
        return func(*args, **kwargs)


class HostSyncCounter:
    """``with HostSyncCounter() as c: step()`` then ``c.events`` (in order), ``c.by_tag()``.

    Only one counter may be active per process; it patches ``torch.Tensor`` and
    ``torch.distributed`` and restores them on exit."""

    def __init__(self):
        self.events: list[SyncEvent] = []
        self._depth = 0
        self._undo: list = []

    def note(self, kind: str) -> None:
        if self._depth == 0:
            self.events.append(SyncEvent(kind, comm.current_tag(), _caller()))

    def _wrap(self, owner, name: str) -> None:
        orig = getattr(owner, name)

        def spy(*args, **kwargs):
            self.note(name.strip("_"))
            self._depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._depth -= 1

        self._undo.append((owner, name, orig))
        setattr(owner, name, spy)

    def __enter__(self) -> HostSyncCounter:
        for name in _TENSOR_READS:
            self._wrap(torch.Tensor, name)
        for name in _HOST_COLLECTIVES:
            self._wrap(dist, name)
        self._mode = _ShapeSpy(self.note)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo = []

    def by_tag(self) -> Counter:
        return Counter(e.tag for e in self.events)

    def count(self, where_contains: str = "", tag_prefix: str = "") -> int:
        """Events whose caller path contains ``where_contains`` and whose tag starts with ``tag_prefix``."""
        return sum(1 for e in self.events if where_contains in e.where and e.tag.startswith(tag_prefix))

    def table(self) -> str:
        """One line per (tag, kind, caller) with its count, most frequent first."""
        rows = Counter((e.tag, e.kind, e.where) for e in self.events)
        return "\n".join(f"{n:4d}  {tag:<12} {kind:<14} {where}" for (tag, kind, where), n in rows.most_common())
