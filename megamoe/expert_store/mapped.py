"""The ``disk`` tier on a CPU: kernels read routed experts straight from the store's file pages.

A converted checkpoint keeps each layer's experts stacked (``megamoe.expert_store.source``), so on a
CPU a layer's local experts are tensor views of the memory-mapped file (read-only, shared)::

    W1 [E_local, 2f, h] = the file's bytes of gate|up, W2 [E_local, h, f] = those of down
                          (views: nothing is read or copied when they are made)

What a process holds of them is the pages mapped into it (they count in its RSS), and that is
what the budget bounds. Before a kernel call touches experts, ``bring`` maps their pages in
(``MADV_POPULATE_READ``: from the kernel's page cache, or read from the disk) and records them,
least recently used first; past the capacity the oldest experts' pages are unmapped
(``MADV_DONTNEED``: the pages stay in the page cache, outside the process, and the next touch
maps them again). No expert is copied: the copy path (``megamoe.expert_store.slot_cache``) reads every
routed expert into a cache slot and copies it into a call's stacks, in the forward and again
in the backward; here both become page-table updates.

Autograd keeps the views (they hold no memory of their own), and a call's backward brings its
experts back in before its kernel's backward touches them (a hook on the call's output:
``ExpertStore.run_call``). The file is never written, so unmapping a page never changes what a
view reads: the bookkeeping bounds memory, the values do not depend on it.

Which stores qualify (else the copy path): the stored dtype is the model's, one file piece
holds the rank's local experts, no ETP slice, no expert placement applied at read time.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Hashable

import torch

from megamoe.expert_store.prefetch import Prefetcher

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MADV_WILLNEED, MADV_DONTNEED, MADV_POPULATE_READ = 3, 4, 22  # <sys/mman.h> (POPULATE_READ: Linux 5.14)

try:  # a CDLL call releases the GIL: a disk read does not stall Python
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    # the advice values are Linux's, and elsewhere MADV_DONTNEED need not drop pages from the RSS
    AVAILABLE = sys.platform.startswith("linux")
except (OSError, AttributeError, TypeError):  # no madvise here: the store copies
    _libc, AVAILABLE = None, False
_POPULATE = [MADV_POPULATE_READ]  # falls back to MADV_WILLNEED where the kernel lacks it


def map_in(addr: int, nbytes: int) -> None:
    """Map the pages of [addr, addr + nbytes) into the process (whole pages, rounded out)."""
    start = addr - addr % PAGE
    length = addr + nbytes - start
    if _libc.madvise(start, length, _POPULATE[0]) != 0 and _POPULATE[0] == MADV_POPULATE_READ:
        err = ctypes.get_errno()
        if err == errno.EINVAL:  # a kernel before 5.14: read ahead instead, pages fault in when touched
            log.info("madvise(MADV_POPULATE_READ) is not supported here: expert pages are read ahead "
                     "with MADV_WILLNEED")
            _POPULATE[0] = MADV_WILLNEED
        _libc.madvise(start, length, MADV_WILLNEED)  # else (a signal, memory pressure): this time only


def _huge_page() -> int:
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


# The page cache may hold a file in huge folios, which a fault maps whole (one PMD): mapping an
# expert in can map up to this much of its neighbours on either side, so unmapping it takes as much.
HUGE = _huge_page()


def map_out(addr: int, nbytes: int, lo: int, hi: int) -> None:
    """Unmap [addr, addr + nbytes) widened to whole huge pages (what mapping it in may have
    mapped), within the file's mapping [lo, hi) (lo: the mapping's start, file offset 0;
    never past it: DONTNEED on anonymous memory would zero it). A neighbour's pages unmapped
    on the way are mapped again when touched: the file is never written, so no value changes."""
    start = lo + (addr - lo) // HUGE * HUGE  # folios are aligned on file offsets: from lo
    end = min(lo + -(-(addr + nbytes - lo) // HUGE) * HUGE, -(-hi // PAGE) * PAGE)
    if end > start:
        _libc.madvise(start, end - start, MADV_DONTNEED)


def _mapping(view: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the file mapping a view lies in (its storage is the whole mapping)."""
    storage = view.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class MappedFile:
    """One safetensors file mapped read-only; ``view`` makes typed tensors of its bytes."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # read-only on purpose: nothing ever writes to the views
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def view(self, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        return self.bytes[start:start + n].view(dtype).view(shape)


class MappedExperts(Prefetcher):
    """The experts whose pages are mapped in, over a rank's tiered layers, least recently used
    first; the same interface to the store as ``ExpertCache`` (``prefetch``, ``stats``,
    ``used``, ``capacity``, ``close``). ``views``: {layer: (W1, W2)} over the mapped files."""

    def __init__(self, views: dict[str, tuple[torch.Tensor, torch.Tensor]], capacity: int, prefetch: bool = True):
        self.views = views
        # each weight's file mapping [start, end) (its storage): what unmapping may widen into, never past
        self.bounds = {layer: [_mapping(w) for w in pair] for layer, pair in views.items()}
        self.entry_bytes = max(w1[0].nbytes + w2[0].nbytes for w1, w2 in views.values())
        self.size = max(0, int(capacity) // self.entry_bytes)
        self.capacity = self.size * self.entry_bytes
        self.mapped: OrderedDict[Hashable, None] = OrderedDict()
        self.busy: set = set()  # the current kernel call's experts: never unmapped under it
        self.stats = {"hits": 0, "misses": 0, "prefetched": 0, "read_bytes": 0}
        self._start_prefetch(prefetch)

    @property
    def used(self) -> int:
        return len(self.mapped) * self.entry_bytes

    def _ranges(self, key):
        """(address, bytes, the mapping's first and end address) of an expert's two weights."""
        layer, e = key
        return [(w[e].data_ptr(), w[e].nbytes, *b) for w, b in zip(self.views[layer], self.bounds[layer])]

    def _map_one(self, key) -> None:
        """Map ``key`` in and record it (unmapping the oldest past the capacity)."""
        ranges = self._ranges(key)
        for addr, n, _, _ in ranges:
            map_in(addr, n)
        with self.lock:
            self.stats["read_bytes"] += sum(r[1] for r in ranges)
            self.mapped[key] = None
            self.mapped.move_to_end(key)
            over = len(self.mapped) - self.size
            oldest = []
            for k in self.mapped if over > 0 else ():  # least recent first; stop once enough are found
                if k not in self.busy:
                    oldest.append(k)
                    if len(oldest) == over:
                        break
            for old in oldest:
                del self.mapped[old]
                for r in self._ranges(old):
                    map_out(*r)

    def bring(self, layer: str, experts) -> tuple[torch.Tensor, torch.Tensor]:
        """Map ``layer``'s ``experts`` in (waiting for a prefetch under way): the layer's views."""
        keys = [(layer, e) for e in experts]
        with self.lock:
            self.busy = set(keys)
            waits = [self.pending[k] for k in keys if k in self.pending]
        for f in waits:
            f.result()
        for key in keys:
            with self.lock:
                hit = key in self.mapped
                if hit:
                    self.mapped.move_to_end(key)
            self.stats["hits" if hit else "misses"] += 1
            if not hit:
                self._map_one(key)
        return self.views[layer]

    def _has(self, key) -> bool:
        return key in self.mapped

    def _fetch(self, key) -> bool:
        with self.lock:
            if key in self.mapped:
                return False
        self._map_one(key)
        return True

    def close(self) -> None:
        """Unmap every page of the store's files, also any a kernel touched after its expert was
        unmapped (the views stay valid: a later touch maps them again)."""
        self._stop_prefetch()
        with self.lock:
            for lo, hi in {b for pair in self.bounds.values() for b in pair}:
                map_out(lo, hi - lo, lo, hi)
            self.mapped.clear()
            self.busy = set()
