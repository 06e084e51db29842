"""Reads queued on one background thread: what the slot cache (``megamoe.expert_store.slot_cache``) and the
mapped store (``megamoe.expert_store.mapped``) share.

A subclass holds at most ``size`` experts and says whether it ``_has(key)`` one already and
how to ``_fetch(key)`` one on the thread (True: fetched). ``prefetch`` queues keys, never more
than half of ``size`` at a time, so that the queue does not evict its own reads; a caller that
needs a key being fetched waits for its future in ``pending`` rather than fetching it twice.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Hashable


class Prefetcher(ABC):
    size: int
    stats: dict

    def _start_prefetch(self, enabled: bool) -> None:
        self.pending: dict[Hashable, Future] = {}
        self.lock = threading.Lock()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="megamoe-experts") if enabled and self.size else None

    @abstractmethod
    def _has(self, key: Hashable) -> bool:
        """Whether ``key`` is held already (under the lock)."""

    @abstractmethod
    def _fetch(self, key: Hashable) -> bool:
        """Bring ``key`` in on the background thread: True if it was brought."""

    def _prefetch_one(self, key: Hashable) -> None:
        try:
            if self._fetch(key):
                self.stats["prefetched"] += 1
        finally:
            with self.lock:
                self.pending.pop(key, None)

    def prefetch(self, keys) -> None:
        """Queue ``keys`` not held or queued, at most half of ``size``."""
        if self.executor is None:
            return
        room = self.size // 2
        with self.lock:
            for key in keys:
                if room <= 0:
                    break
                room -= 1
                if not self._has(key) and key not in self.pending:
                    self.pending[key] = self.executor.submit(self._prefetch_one, key)

    def drain(self) -> None:
        """Wait for every queued read."""
        with self.lock:
            futures = list(self.pending.values())
        for f in futures:
            f.result()

    def _stop_prefetch(self) -> None:
        self.drain()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
