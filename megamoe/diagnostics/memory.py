"""Process memory readings: host RSS that is not inherited from a parent process, and the
live tensor bytes a device would hold (``LiveTensorBytes``).

``ru_maxrss`` survives fork and exec on Linux, so a child started from a large process
reports the parent's peak; ``VmHWM`` belongs to the process's own address space.
"""
from __future__ import annotations

import resource
import weakref


def _status_mib(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mib() -> float:
    """Current resident set size."""
    return _status_mib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mib() -> float:
    """Peak resident set size of this process (since exec, or since ``reset_peak``)."""
    return _status_mib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Restart the peak from the current RSS (Linux ``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def saved_tensor_bytes(fn, exclude=()) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saves for backward while ``fn()`` runs, its
    result): what a forward holds until its backward. Storages of the ``exclude`` tensors (the
    parameters, typically) are not counted."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


class LiveTensorBytes:
    """Bytes of live tensor storage, and their peak: on a CPU run, what
    ``torch.cuda.max_memory_allocated`` is on a GPU (the memory a device would have to hold),
    free of the host allocator's caching and of the interpreter, which RSS counts.

    While active (``with tracker:``), every tensor an operator returns is counted until its
    storage is freed (a weak reference's finalizer); ``add`` counts tensors that existed before
    (parameters, gradients, optimizer states). Views and in-place results share their base's
    storage and count once. Meta tensors hold nothing. Not counted: a kernel's scratch
    buffers that never become tensors, and memory outside torch (gloo's, Python's).

        tracker = LiveTensorBytes()
        tracker.add(model.parameters())
        with tracker:
            step()
        tracker.peak   # bytes
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        owner = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                owner._count(out, func)
                return out

        self._mode = _Mode()
        self.live: dict[int, int] = {}  # id(storage) -> bytes
        self.current = 0
        self.peak = 0
        self.peak_op = None  # the operator whose result set the peak (where it happened)

    def add(self, tensors) -> None:
        """Count tensors allocated before tracking began (``None`` entries are skipped)."""
        for t in tensors:
            if t is not None:
                self._count(t)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _count(self, out, func=None) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = id(storage), storage.nbytes()
            if key in self.live:  # seen before; an in-place resize may have changed its size
                self.current += size - self.live[key]
            elif size:
                self.current += size
                weakref.finalize(storage, self._free, key)
            else:
                continue
            self.live[key] = size
            if self.current > self.peak:
                self.peak, self.peak_op = self.current, func

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __enter__(self) -> "LiveTensorBytes":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
