"""Decoding under context parallelism with the KV cache split by sequence over the CP ranks.

A ``ContextSplitCache`` (contiguous) or ``PagedContextSplitCache`` (paged blocks, fp32, int8 or
fp8) is made with the CP group. Softmax attention (A, S), block-sparse attention (B), MLA (M) and
DSA (D, R, I) keep in it only this rank's share of the sequence's keys (MLA, DSA: latents), each
with its global position:

- the prefill's own shard stays where it was computed: CP rank r keeps its chunks r and
  2·CP-1-r (``append_prefill``), nothing is all-gathered into the cache;
- every later token (decode steps, later prefill chunks) is kept by rank ``position % CP``
  (round-robin, so the ranks' shares stay within one token of each other).

A forward after the prefill runs the same on every CP rank (every rank has every query): each
rank attends its queries over its own keys (a tile kernel per ``TILE_TOKENS`` keys, masks from
global positions: causal, sliding window) and gets an unnormalised part (out [b, H, t, dv], lse
[b, H, t]); one all-gather of [b, H, t, dv + 1] per layer brings every rank's part, and each
rank merges them in rank order by their log-sum-exps (``tiled.merge``), so every rank ends the
layer with the same output, that of attention over the whole cache.

DSA (D, R, I) and B keep their indexer keys (and I's pool gates, a few numbers a token) whole
on every rank, so every rank selects the same top-k keys or blocks over the whole sequence,
then attends over the selected keys it holds (``attend_selected``, ``attend_tokens``), merged
as above.

A sliding window (S) drops the keys the window has passed on each rank (``keep_last``).
Other mixers' time-axis tensors (D/I/B's indexer keys, V4's window and compressed entries) and
linear mixers' states stay as the plain caches keep them: the whole sequence on every rank
(replicated), computed identically on every CP rank.
"""
from __future__ import annotations

import torch

from megamoe.core.errors import ConfigError
from megamoe.layers.cache.decode import InferenceCache, LayerState
from megamoe.layers.cache.paged import TILE_TOKENS, PagedCache, PagedLayerState
from megamoe.layers.ops.attention.context import allowed_mask
from megamoe.layers.ops.attention.tiled import (empty_part, merge, partial_attention, partial_block_sparse_attention,
                                                partial_latent_attention, partial_sparse_latent_attention)
from megamoe.parallel import comm
from megamoe.parallel.groups import group_rank, group_size


class SplitKeys:
    """The split part of a layer state (a mixin before ``LayerState`` or ``PagedLayerState``):
    ``positions`` [n] (CPU, increasing) are the global positions of the n keys this rank holds.
    Storage comes from the class it is mixed into: ``put(name, x)`` appends x [b, t, ...] after
    the held keys, ``held(name, a, e)`` reads held keys a..e-1 [b, e - a, ...], ``drop(n)`` forgets
    the first n."""

    def split_init(self, cache) -> None:
        self.cache = cache
        self.positions = torch.zeros(0, dtype=torch.long)
        self.split_names: tuple[str, ...] = ()
        self.end = 0  # positions below it have been seen (the sliding window counts back from it)

    def append_prefill(self, cp, local: dict[str, torch.Tensor], gathered=None) -> None:
        """This rank's chunks [b, s_local, ...] stay here (``gathered`` is not needed)."""
        for name, x in local.items():
            self.put(name, x.detach())
        self.split_names, self.end = tuple(local), cp.seq_len
        self.positions = torch.cat([self.positions, cp.local_index()])

    def keep_own(self, new: dict[str, torch.Tensor], t: int) -> torch.Tensor:
        """Keep the new time steps this rank owns (position % CP); -> the queries' positions [t]."""
        c = self.cache
        q_pos = torch.arange(c.seen, c.seen + t)
        mine = (q_pos % c.cp_size == c.cp_rank).nonzero().squeeze(1)
        if mine.numel():
            for name, x in new.items():
                self.put(name, x.detach().index_select(1, mine.to(x.device)))
        self.split_names, self.end = tuple(new), c.seen + t
        self.positions = torch.cat([self.positions, q_pos[mine]])
        return q_pos

    def tiles(self, names: tuple[str, ...], q_pos: torch.Tensor, window: int, device):
        """The held keys ``TILE_TOKENS`` at a time: (each name's [b, n, ...], mask [1, t, n] or None
        where every key is visible to every query); a tile no query may see is skipped."""
        for a in range(0, self.positions.numel(), TILE_TOKENS):
            e = min(self.positions.numel(), a + TILE_TOKENS)
            mask = allowed_mask(q_pos, self.positions[a:e], window)
            if not bool(mask.any()):
                continue
            yield (*(self.held(name, a, e) for name in names), None if bool(mask.all()) else mask.to(device))

    def attend_kv(self, cache, q, k, v, core, window: int = 0) -> torch.Tensor:
        """q [b, t, hq, d] over the keys of every rank (k, v [b, t, hk, d]: this step's) -> [b, t, hq, dv]."""
        q_pos = self.keep_own({"k": k, "v": v}, q.size(1))
        part = partial_attention(q, self.tiles(("k", "v"), q_pos, window, q.device), core.scale, core.tiles,
                                 dv=v.size(-1))
        return cache.merge_ranks(part).transpose(1, 2).to(q.dtype)

    def attend_latent(self, cache, q_lat, q_rope, c, k_rope, core, scale: float) -> torch.Tensor:
        """MLA's absorbed attention over the latents of every rank -> [b, s, H, r]."""
        q_pos = self.keep_own({"c": c, "k_rope": k_rope}, q_lat.size(1))
        part = partial_latent_attention(q_lat, q_rope, self.tiles(("c", "k_rope"), q_pos, 0, q_lat.device), scale)
        return cache.merge_ranks(part).transpose(1, 2).to(q_lat.dtype)

    def attend_selected(self, cache, q_lat, q_rope, c, k_rope, idx, core, scale: float) -> torch.Tensor:
        """DSA's attention over the selected latents of every rank: idx [b, t, K] are global positions
        (the indexer selects over its keys, kept whole on every rank); this rank attends over those
        it holds (the math partial: ``core``'s fused kernel returns no lse) -> [b, t, H, r]."""
        return self.attend_held(cache, {"c": c, "k_rope": k_rope}, q_lat, q_lat.size(-1), idx, False,
                                lambda c_held, kr_held, slots:
                                partial_sparse_latent_attention(q_lat, q_rope, c_held, kr_held, slots, scale))

    def attend_tokens(self, cache, q, k, v, tok, core, scale: float) -> torch.Tensor:
        """Block-sparse attention over the kept keys of every rank: tok [b, t, G, N] are global
        positions (the block indexer selects over its keys, kept whole on every rank); this rank
        attends over those it holds -> [b, t, H, d]."""
        return self.attend_held(cache, {"k": k, "v": v}, q, v.size(-1), tok, True,
                                lambda k_held, v_held, slots: partial_block_sparse_attention(q, k_held, v_held, slots,
                                                                                             scale))

    def attend_held(self, cache, new: dict[str, torch.Tensor], q: torch.Tensor, dv: int, idx: torch.Tensor,
                    grouped: bool, part) -> torch.Tensor:
        """Keep ``new``'s owned steps; ``part(*held keys of new's names, slots)`` -> (out, lse) over the
        keys of idx (global positions) this rank holds (none: nothing), merged over the ranks ->
        [b, t, H, dv] in q's dtype."""
        self.keep_own(new, q.size(1))
        if not self.positions.numel():
            return cache.merge_ranks(empty_part(q.transpose(1, 2), dv)).transpose(1, 2).to(q.dtype)
        own = part(*self.held_selected(tuple(new), self.held_slots(idx), grouped))
        return cache.merge_ranks(own).transpose(1, 2).to(q.dtype)

    def held_slots(self, idx: torch.Tensor) -> torch.Tensor:
        """Global positions idx [...] (-1 = none) -> their slots among the held keys, -1 where this
        rank does not hold them (at least one key is held)."""
        held = self.positions.to(idx.device)
        slot = torch.searchsorted(held, idx.clamp(min=0)).clamp(max=held.numel() - 1)
        return torch.where((idx >= 0) & (held[slot] == idx), slot, -1)

    def keep_last(self, names: tuple[str, ...], keep: int) -> None:
        """Sliding window: forget the held keys more than ``keep`` positions before ``end``."""
        if not set(names) <= set(self.split_names):
            return super().keep_last(names, keep)
        n = int((self.positions < self.end - keep).sum())
        if n:
            self.drop(n)
            self.positions = self.positions[n:]


class SplitLayerState(SplitKeys, LayerState):
    """Contiguous storage: each split name is one tensor [b, n, ...] of the held keys."""

    def __init__(self, cache):
        super().__init__()
        self.split_init(cache)

    def put(self, name: str, x: torch.Tensor) -> None:
        LayerState.append_time(self, name, x)

    def held(self, name: str, a: int, e: int) -> torch.Tensor:
        return self[name][:, a:e]

    def drop(self, n: int) -> None:
        for name in self.split_names:
            self[name] = self[name][:, n:]

    def held_selected(self, names: tuple[str, ...], slots: torch.Tensor, grouped: bool):
        """What a sparse attention reads for the held slots [b, s, (G,) K]: here every held key, slots."""
        return (*(self[name] for name in names), slots)


class PagedSplitLayerState(SplitKeys, PagedLayerState):
    """Paged storage: a ``BlockStore`` per split name whose slots are the held keys in order
    (``offset`` slots dropped from the front, their whole blocks freed)."""

    def __init__(self, cache):
        super().__init__(cache)
        self.split_init(cache)
        self.offset = 0

    def put(self, name: str, x: torch.Tensor) -> None:
        self.store(name, x).append(x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device))

    def held(self, name: str, a: int, e: int) -> torch.Tensor:
        store = self.stores[name]
        return store.read(self.offset + a, self.offset + e, torch.zeros(len(store.lengths), dtype=torch.long))

    def held_selected(self, names: tuple[str, ...], slots: torch.Tensor, grouped: bool):
        """Every held key (fp32), or only the chosen slots gathered and dequantised (int8/fp8, as
        ``PagedLayerState.select_keys``) -> (each name's keys, slots into them)."""
        if self.cache.kv_dtype == "fp32":
            n = self.positions.numel()
            return (*(self.held(name, 0, n) for name in names), slots)
        times = torch.where(slots >= 0, slots + self.offset, -1)
        pad = torch.zeros(self.cache.batch_size, dtype=torch.long)
        return self.gathered([self.stores[name] for name in names], times, pad, slots, grouped)

    def drop(self, n: int) -> None:
        self.offset += n
        for name in self.split_names:
            store = self.stores[name]
            for row in range(len(store.tables)):
                store.drop_before(row, self.offset)


class ContextSplit:
    """What both split caches add to their cache class (a mixin before it)."""

    def split_over(self, group) -> None:
        self.group, self.cp_size, self.cp_rank = group, group_size(group), group_rank(group)
        if self.pad is not None:
            raise ConfigError(f"parallel.cp={self.cp_size}: decoding with the cache split over CP needs prompts of "
                              f"equal length (this batch is left-padded)")

    def merge_ranks(self, part) -> torch.Tensor:
        """This rank's (out [b, H, t, dv], lse [b, H, t]) -> the merged out over every CP rank's keys
        (fp32, [b, H, t, dv], the same on every rank): one all-gather of [b, H, t, dv + 1]."""
        out, lse = part
        if self.cp_size == 1:
            return out
        parts = comm.all_gather_tensor(torch.cat([out, lse.unsqueeze(-1)], -1).unsqueeze(0), 0, self.group)
        acc = None
        for p in parts:  # in rank order on every rank: bitwise the same result everywhere
            acc = merge(acc, (p[..., :-1], p[..., -1]))
        return acc[0]

    def snapshot(self):
        raise ConfigError("a decode cache split over CP cannot be rolled back: speculative decoding runs in one "
                          "process")


class ContextSplitCache(ContextSplit, InferenceCache):
    """``InferenceCache`` whose attention keys are split over the CP ``group`` (module docstring)."""

    def __init__(self, batch_size: int, pad: torch.Tensor | None = None, *, group=None):
        super().__init__(batch_size, pad)
        self.split_over(group)

    def new_state(self, layer_number) -> LayerState:
        return SplitLayerState(self)


class PagedContextSplitCache(ContextSplit, PagedCache):
    """``PagedCache`` (blocks; fp32, int8 or fp8) whose attention keys are split over the CP ``group``."""

    def __init__(self, batch_size: int, pad: torch.Tensor | None = None, *, group=None, block_size: int = 16,
                 kv_dtype: str = "fp32"):
        super().__init__(batch_size, pad, block_size=block_size, kv_dtype=kv_dtype)
        self.split_over(group)

    def new_state(self, layer_number) -> LayerState:
        return PagedSplitLayerState(self)
