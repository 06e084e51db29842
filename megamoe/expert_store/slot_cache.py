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

On a GPU the pools live on the device and ``StreamOrder`` orders the copies: reads land in a
pinned host buffer and are copied on a side CUDA stream whose event the current stream waits
for before it reads the slot; the other way round, a refill of a slot waits on the side stream
for the event recorded after the last copy out of it (the host releases a slot as soon as that
copy is queued, so without the wait the refill could overwrite the slot before the queued copy
has read it). tests/test_gpu_path.py checks that order on CPU through stand-in streams;
tests/test_gpu.py runs it on a GPU.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

import torch

from megamoe.expert_store.prefetch import Prefetcher


class StreamOrder:
    """The CUDA side of a cache on ``device``: the side stream that fills slots and the events
    that order each slot's fill before its copies out and its copies out before its next fill."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, torch.cuda.Stream(device)
        self.filled: dict[int, tuple] = {}  # slot -> (the fill's event, its pinned host buffers)
        self.read: dict[int, object] = {}  # slot -> the event after the last copy out of it

    def host_buffers(self, shapes: tuple, dtype: torch.dtype) -> tuple:
        return tuple(torch.empty(s, dtype=dtype, pin_memory=True) for s in shapes)

    def fill(self, slot: int, pool: tuple, host: tuple) -> None:
        """Copy ``host`` into ``pool[i][slot]`` on the side stream, after any copy out of the slot."""
        with torch.cuda.stream(self.stream):
            read = self.read.pop(slot, None)
            if read is not None:  # a copy out of the slot may still be queued: it goes first
                self.stream.wait_event(read)
            for dst, src in zip(pool, host):
                dst[slot].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.filled[slot] = (event, host)  # the pinned buffers live until the copy is done

    def before_copy_out(self, slot: int) -> None:
        done = self.filled.pop(slot, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done[0])

    def after_copy_out(self, slot: int) -> None:
        """Recorded before the slot is released: its next fill waits for it."""
        read = torch.cuda.Event()
        read.record(torch.cuda.current_stream(self.device))
        self.read[slot] = read

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def clear(self) -> None:
        self.filled.clear()
        self.read.clear()


class ExpertCache(Prefetcher):
    """``load(key, w1, w2)`` fills contiguous CPU tensors of ``shapes`` with an expert's values.
    ``order``: the copies' ordering on a GPU (default: ``StreamOrder`` on a CUDA ``device``)."""

    def __init__(self, capacity: int, device: torch.device, dtype: torch.dtype, shapes: tuple, load: Callable,
                 prefetch: bool = True, order: StreamOrder | None = None):
        self.device, self.dtype, self.shapes, self.load = torch.device(device), dtype, shapes, load
        self.entry_bytes = sum(torch.Size(s).numel() for s in shapes) * dtype.itemsize
        n = max(0, int(capacity) // self.entry_bytes)
        self.capacity = n * self.entry_bytes
        self.pool = tuple(torch.empty(n, *s, dtype=dtype, device=self.device) for s in shapes)
        self.free = list(range(n))
        self.slots: OrderedDict[Hashable, int] = OrderedDict()
        self.busy: dict[int, int] = {}  # slot -> copies in progress
        self.size = n
        self.order = order if order is not None or self.device.type != "cuda" else StreamOrder(self.device)
        self.cuda = self.order is not None
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
            host = self.order.host_buffers(self.shapes, self.dtype)
            self.load(key, *host)
            self.order.fill(slot, self.pool, host)
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
                self.order.before_copy_out(slot)
            out1.copy_(self.pool[0][slot])
            out2.copy_(self.pool[1][slot])
            if self.cuda:  # before the slot is released: a refill waits for this copy
                self.order.after_copy_out(slot)
        finally:
            with self.lock:
                self.busy[slot] -= 1

    def _direct(self, key: Hashable, out1: torch.Tensor, out2: torch.Tensor) -> None:
        self.stats["read_bytes"] += self.entry_bytes
        if not self.cuda:
            self.load(key, out1, out2)
            return
        host = self.order.host_buffers(self.shapes, self.dtype)
        self.load(key, *host)
        out1.copy_(host[0], non_blocking=True)
        out2.copy_(host[1], non_blocking=True)
        self.order.synchronize()  # the pinned buffers are freed next

    def close(self) -> None:
        self._stop_prefetch()
        with self.lock:
            self.slots.clear()
            if self.cuda:
                self.order.clear()
            self.free = list(range(len(self.pool[0])))
