"""The bounded LRU cache of hot experts: a fixed pool of slots, filled on demand and by a
prefetch thread.

One slot holds one expert of one layer, this rank's slices of both weights::

    pool1 [slots, 2f/etp, h], pool2 [slots, h, f/etp]     allocated once: slots = capacity // expert bytes
    key (layer, expert) -> slot                            least recently used first

The pool is allocated once so that the cache's memory is fixed: reading experts into fresh
tensors and freeing them again left the host allocator holding several times the budget
(measured: ~100 MiB of freed-but-kept heap over a 14 MiB cache on a 72 MiB model).

``copy(key, out1, out2)`` copies an expert into the caller's tensors (a kernel call's stacks):
from its slot, or, on a miss, after reading it into the least recently used slot (directly
into ``out1``/``out2`` when no slot is free). ``prefetch`` queues reads into slots on one
background thread. A slot being copied from or read into is never evicted.

On a GPU the pools live on the device; reads land in a pinned host buffer and are copied on
a side CUDA stream whose event the current stream waits for before it reads the slot; the
other way round, a refill of a slot waits on the side stream for the event recorded after the
last copy out of it (the host releases a slot as soon as that copy is queued, so without the
wait the refill could overwrite the slot before the queued copy has read it). This path
cannot run on the CPU machines the tests use (tests/test_gpu.py runs it).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

import torch

from megamoe.expert_store.prefetch import Prefetcher


class ExpertCache(Prefetcher):
    """``load(key, w1, w2)`` fills contiguous CPU tensors of ``shapes`` with an expert's values."""

    def __init__(self, capacity: int, device: torch.device, dtype: torch.dtype, shapes: tuple, load: Callable,
                 prefetch: bool = True):
        self.device, self.dtype, self.shapes, self.load = torch.device(device), dtype, shapes, load
        self.entry_bytes = sum(torch.Size(s).numel() for s in shapes) * dtype.itemsize
        n = max(0, int(capacity) // self.entry_bytes)
        self.capacity = n * self.entry_bytes
        self.pool = tuple(torch.empty(n, *s, dtype=dtype, device=self.device) for s in shapes)
        self.free = list(range(n))
        self.slots: OrderedDict[Hashable, int] = OrderedDict()
        self.busy: dict[int, int] = {}  # slot -> copies in progress
        self.events: dict[int, object] = {}  # slot -> the side stream's copy event (GPU)
        self.reads: dict[int, object] = {}  # slot -> the event after the last copy out of it (GPU)
        self.size = n
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = {"hits": 0, "misses": 0, "prefetched": 0, "read_bytes": 0}
        self._start_prefetch(prefetch)

    @property
    def used(self) -> int:
        return len(self.slots) * self.entry_bytes

    # ---- slots --------------------------------------------------------------------------

    def _claim(self) -> int | None:
        """A slot to read into (free, else the least recently used one not busy); under the lock."""
        if self.free:
            return self.free.pop()
        for key, slot in self.slots.items():
            if not self.busy.get(slot):
                del self.slots[key]
                return slot
        return None

    def _fill(self, slot: int, key: Hashable) -> None:
        """Read ``key`` into ``slot`` (the slot is reserved: busy, not yet in ``slots``)."""
        if not self.cuda:
            self.load(key, self.pool[0][slot], self.pool[1][slot])
        else:
            host = tuple(torch.empty(s, dtype=self.dtype, pin_memory=True) for s in self.shapes)
            self.load(key, *host)
            with torch.cuda.stream(self.stream):
                read = self.reads.pop(slot, None)
                if read is not None:  # a copy out of the slot may still be queued: it goes first
                    self.stream.wait_event(read)
                for dst, src in zip(self.pool, host):
                    dst[slot].copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[slot] = (event, host)  # the pinned buffers live until the copy is done
        self.stats["read_bytes"] += self.entry_bytes

    def _read_into_slot(self, key: Hashable, hold: bool = False) -> int | None:
        """The slot holding ``key``, read now if needed (None: no slot to spare). ``hold``: the
        slot is returned busy (the caller copies from it, then releases it)."""
        with self.lock:
            slot = self.slots.get(key)
            if slot is not None:
                self.busy[slot] = self.busy.get(slot, 0) + hold
                return slot
            slot = self._claim()
            if slot is None:
                return None
            self.busy[slot] = self.busy.get(slot, 0) + 1  # reserved while it is read
        try:
            self._fill(slot, key)
        except BaseException:
            with self.lock:
                self.busy[slot] -= 1
                self.free.append(slot)
            raise
        with self.lock:
            self.busy[slot] -= 0 if hold else 1
            self.slots[key] = slot
        return slot

    def _has(self, key: Hashable) -> bool:
        return key in self.slots

    def _fetch(self, key: Hashable) -> bool:
        return self._read_into_slot(key) is not None

    # ---- what the store calls -----------------------------------------------------------

    def copy(self, key: Hashable, out1: torch.Tensor, out2: torch.Tensor) -> None:
        """Copy expert ``key`` into ``out1``/``out2`` (on the cache's device)."""
        with self.lock:
            future = self.pending.get(key) if key not in self.slots else None
        if future is not None:
            future.result()  # the prefetch thread is reading it: wait rather than read twice
        with self.lock:
            slot = self.slots.get(key)
            if slot is not None:
                self.slots.move_to_end(key)
                self.busy[slot] = self.busy.get(slot, 0) + 1
        if slot is None:
            self.stats["misses"] += 1
            slot = self._read_into_slot(key, hold=True)
            if slot is None:  # no slot to spare: read straight into the caller's tensors
                self._direct(key, out1, out2)
                return
        else:
            self.stats["hits"] += 1
        try:
            if self.cuda:
                done = self.events.pop(slot, None)
                if done is not None:
                    torch.cuda.current_stream(self.device).wait_event(done[0])
            out1.copy_(self.pool[0][slot])
            out2.copy_(self.pool[1][slot])
            if self.cuda:  # recorded before the slot is released: a refill waits for it
                read = torch.cuda.Event()
                read.record(torch.cuda.current_stream(self.device))
                self.reads[slot] = read
        finally:
            with self.lock:
                self.busy[slot] -= 1

    def _direct(self, key: Hashable, out1: torch.Tensor, out2: torch.Tensor) -> None:
        self.stats["read_bytes"] += self.entry_bytes
        if not self.cuda:
            self.load(key, out1, out2)
            return
        host = tuple(torch.empty(s, dtype=self.dtype, pin_memory=True) for s in self.shapes)
        self.load(key, *host)
        out1.copy_(host[0], non_blocking=True)
        out2.copy_(host[1], non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the pinned buffers are freed next

    def close(self) -> None:
        self._stop_prefetch()
        with self.lock:
            self.slots.clear()
            self.events.clear()
            self.reads.clear()
            self.free = list(range(len(self.pool[0])))
