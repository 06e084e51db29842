"""Paged decode cache: time-axis states in fixed-size blocks, optionally int8.

``PagedCache`` is an ``InferenceCache`` whose layers keep every time-axis tensor (softmax keys
and values, MLA's latent and rotated key, DSA's indexer keys) in a ``BlockStore``: a pool of
blocks ``[num_blocks, block_size, *feature]`` and, per sequence, a block table listing its
blocks in order. A sequence's real tokens only are stored (its left padding never takes a
block); blocks are taken from a free list as the sequence grows and returned when it leaves
the batch or, for a sliding-window layer, when the window has passed them. Linear mixers'
fixed-size states (conv window, recurrent state) stay plain items of the same layer state.

Reading gives the mixers exactly what the contiguous cache gives them, [b, T, *feature] on the
batch's common time axis, with zeros at padded slots (masked by every reader), so the logits
are bitwise those of the contiguous cache (tests/test_paged_cache.py).

``kv_dtype="int8"``: values are stored as int8 with one fp32 scale per block and head (per
block and leading feature dims, i.e. per head for [h, d] keys, one per block for a latent
[r]); scale = amax / 127 over the block's tokens. ``kv_dtype="fp8"``: the same with
float8 e4m3 values (scale = amax / 448; torch casts to it on CPU too); ``blocks.BlockStore``.
A quantised cache is never dequantised whole: the readers go through the ``LayerState`` calls
that read a bounded tile (``tile_steps``: up to ``TILE_BYTES`` of fp32 values, 64 to 512 time
steps) or only the chosen steps --
softmax attention (A, S) and MLA's latents (M) in ``attend_kv``/``attend_latent`` (a tile
kernel per tile, merged by log-sum-exp); the indexers' keys (D, I, B) in ``time_tiles`` /
``position_tiles`` (scored a tile at a time); the sparse attentions (D, R, I, B) in
``attend_selected``/``attend_tokens`` (through ``select_keys``: only the selected steps gathered
and dequantised). So decode memory grows with
the quantised bytes, plus one tile and the indexers' per-key scores (4 bytes a key and query
head for B, a few per key and query for D and I). DeepSeek-V4's compressed entries likewise:
``extend_entries``, then ``entry_tiles`` (C's indexer keys), ``select_entries`` (C's chosen
entries), ``attend_entries`` (H's, a tile at a time).
"""
from __future__ import annotations

import torch

from megamoe.core.errors import ConfigError
from megamoe.layers.cache.blocks import BlockStore
from megamoe.layers.cache.decode import InferenceCache, LayerState
from megamoe.layers.cache.reserved import ReservedBlockStore
from megamoe.layers.ops.attention.tiled import tiled_attention, tiled_latent_attention_decode

KV_DTYPES = ("fp32", "int8", "fp8")  # fp32: the values' own dtype; fp8: e4m3
TILE_TOKENS = 512  # most time steps a quantised cache dequantises at once when attention reads it
TILE_BYTES = 256 << 10  # ... fewer where their fp32 values would pass this (every row and name of the tile),
TILE_MIN_TOKENS = 64  # but not fewer than this (a kernel per handful of steps would be slow on a GPU)
RESERVED_TILES = 32  # most tiles a read of a reserved cache takes (a compiled step unrolls its tile loop)


class PagedLayerState(LayerState):
    """A mixer's state whose time-axis tensors live in ``BlockStore``s of its cache."""

    def __init__(self, cache: "PagedCache"):
        super().__init__()
        self.cache = cache
        self.stores: dict[str, BlockStore] = {}
        self.keep: int | None = None  # sliding window: time steps kept after each forward

    def store(self, name: str, x: torch.Tensor, time_axis: bool = True) -> BlockStore:
        """The block store of ``name`` (made for ``x``'s features and dtype on first use; a time-axis
        one of a reserved cache (``PagedCache.reserve``) with its blocks reserved)."""
        c = self.cache
        if name not in self.stores:
            args = (c.batch_size, c.block_size, tuple(x.shape[2:]), x.dtype, x.device,
                    None if c.kv_dtype == "fp32" else c.kv_dtype)
            self.stores[name] = BlockStore(*args) if c.steps is None or not time_axis else \
                ReservedBlockStore(*args, c.pad_or_zeros(), c.steps)
        return self.stores[name]

    def first_kept(self) -> int:
        """The first time step reads start at (a sliding window's: ``keep`` steps back)."""
        return 0 if self.keep is None else max(0, self.cache.seen - self.keep)

    def extend(self, new: dict[str, torch.Tensor]) -> None:
        c = self.cache
        if c.steps is None and torch.compiler.is_compiling():
            raise ConfigError("a paged cache in a compiled step needs its steps reserved first "
                              "(cache.reserve(prompt + new tokens)): its block bookkeeping runs on the host")
        for name, x in new.items():
            valid = c.valid(x.size(1), x.device)
            self.store(name, x).append_at(x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
                                          if valid is None else valid, c.seen, c.pad_or_zeros())

    def append_time(self, name: str, x: torch.Tensor) -> torch.Tensor:
        self.extend({name: x})
        return self.stores[name].read(self.first_kept(), self.cache.seen + x.size(1), self.cache.pad_or_zeros())

    def attend_kv(self, cache, q, k, v, core, window: int = 0) -> torch.Tensor:
        """``LayerState.attend_kv``; a quantised cache dequantises one tile of keys and values at a
        time (``tiled_attention``: the core's tile kernel, tiles merged by their log-sum-exps), never
        the whole history."""
        if cache.kv_dtype == "fp32":
            return super().attend_kv(cache, q, k, v, core, window)
        self.extend({"k": k, "v": v})
        return tiled_attention(q, self.time_tiles(cache, ("k", "v"), q.size(1), window), core.scale, core.tiles)

    def attend_latent(self, cache, q_lat, q_rope, c, k_rope, core, scale: float) -> torch.Tensor:
        """``LayerState.attend_latent``; quantised: one tile of latents at a time."""
        if cache.kv_dtype == "fp32":
            return super().attend_latent(cache, q_lat, q_rope, c, k_rope, core, scale)
        self.extend({"c": c, "k_rope": k_rope})
        return tiled_latent_attention_decode(q_lat, q_rope, self.time_tiles(cache, ("c", "k_rope"), q_lat.size(1)),
                                             scale)

    def tile_steps(self, names: tuple[str, ...]) -> int:
        """Time steps per tile: as many as keep their dequantised fp32 values (all rows and names
        together) within ``TILE_BYTES``, between ``TILE_MIN_TOKENS`` and ``TILE_TOKENS``; for a
        reserved cache at least 1/``RESERVED_TILES`` of its steps (a compiled step's graph holds
        every tile of its loop: past 32 tiles of context the tiles grow instead of the graph)."""
        per_step = sum(len(s.tables) * int(torch.Size(s.feature).numel()) for s in map(self.stores.get, names)) * 4
        steps = max(1, min(TILE_TOKENS, max(TILE_MIN_TOKENS, TILE_BYTES // max(1, per_step))))
        reserved = self.cache.steps
        return steps if reserved is None else max(steps, -(-reserved // RESERVED_TILES))

    def time_tiles(self, cache, names: tuple[str, ...], t_q: int, window: int = 0):
        """``LayerState.time_tiles``: the fp32 cache in one tile (as the contiguous cache reads it), a
        quantised one ``tile_steps`` at a time, each dequantised as it is read."""
        c = self.cache
        start, end = c.tile_span(self.first_kept(), c.seen + t_q)
        step = end - start if c.kv_dtype == "fp32" else self.tile_steps(names)
        pad, device = c.pad_or_zeros(), self.stores[names[0]].device
        for a in range(start, end, max(1, step)):
            e = min(end, a + step)
            yield (*(self.stores[name].read(a, e, pad) for name in names), c.key_mask(t_q, a, e, window, device))

    def position_tiles(self, cache, names: tuple[str, ...], t_q: int, multiple: int = 1):
        """``LayerState.position_tiles``: the fp32 cache in one tile, a quantised one ``tile_steps``
        (rounded down to ``multiple``) at a time; the blocks hold each row's positions already."""
        c = self.cache
        end = c.tile_span(0, c.seen + t_q)[1]
        step = end if c.kv_dtype == "fp32" else max(multiple, self.tile_steps(names) // multiple * multiple)
        zeros = torch.zeros(c.batch_size, dtype=torch.long)
        for a in range(0, end, step):
            yield tuple(self.stores[name].read(a, min(end, a + step), zeros) for name in names)

    def select_keys(self, cache, new: dict[str, torch.Tensor], idx: torch.Tensor,
                    grouped: bool = False) -> tuple[torch.Tensor, ...]:
        """``LayerState.select_keys``; quantised: the s K chosen steps gathered and dequantised (with
        ``grouped``, key head g's steps only), laid out query after query: idx' = query * K + slot."""
        if cache.kv_dtype == "fp32":
            return super().select_keys(cache, new, idx, grouped)
        self.extend(new)
        times = torch.where(idx >= 0, idx + self.first_kept(), -1)
        return self.gathered([self.stores[name] for name in new], times, self.cache.pad_or_zeros(), idx, grouped)

    @staticmethod
    def gathered(stores, times: torch.Tensor, pad: torch.Tensor, idx: torch.Tensor, grouped: bool = False):
        """Each store's steps ``times`` (idx [b, s, (G,) K] placed on the stores' axis) gathered and
        laid out query after query -> (each [b, s K, ...], idx' = query * K + slot, -1 kept)."""
        s, k = idx.size(1), idx.size(-1)
        heads = torch.arange(idx.size(2), device=idx.device)[:, None].expand_as(idx) if grouped else None
        out = []
        for store in stores:
            got = store.gather(times, pad, heads)                                      # [b, s, (G,) K, ...]
            out.append((got.transpose(2, 3) if grouped else got).flatten(1, 2))      # [b, s K, ...]
        slots = torch.arange(s * k, device=idx.device).view(s, *((1,) if grouped else ()), k)
        return (*out, torch.where(idx >= 0, slots, -1))

    def extend_entries(self, name: str, x: torch.Tensor, valid: torch.Tensor) -> None:
        self.store(name, x, time_axis=False).append(x, valid)

    def append_entries(self, name: str, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``LayerState.append_entries`` in blocks: each row's entries follow its stored ones (their
        own axis), read back right-padded with zeros, as the contiguous cache gives them."""
        self.extend_entries(name, x, valid)
        store = self.stores[name]
        return store.read(0, max(store.lengths, default=0), self.no_pad(store)), \
            torch.tensor(store.lengths, dtype=torch.long, device=x.device)

    @staticmethod
    def no_pad(store: BlockStore) -> torch.Tensor:
        """Entries sit from each row's slot 0 on their own axis (no left padding)."""
        return torch.zeros(len(store.lengths), dtype=torch.long)

    def entry_tiles(self, names: tuple[str, ...]):
        """``LayerState.entry_tiles``: the fp32 cache in one tile, a quantised one ``tile_steps`` entries
        at a time."""
        stores = [self.stores[name] for name in names]
        width = max(stores[0].lengths, default=0)
        step = width if self.cache.kv_dtype == "fp32" else self.tile_steps(names)
        for a in range(0, max(width, 1), max(step, 1)):
            yield (a, *(store.read(a, min(width, a + step), self.no_pad(store)) for store in stores))

    def attend_entries(self, name: str, whole, tiled):
        """``LayerState.attend_entries``: the fp32 cache's entries whole, a quantised one's in tiles."""
        store = self.stores[name]
        if self.cache.kv_dtype == "fp32":
            return whole(store.read(0, max(store.lengths, default=0), self.no_pad(store)))
        return tiled(self.entry_tiles((name,)))

    def select_entries(self, name: str, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``LayerState.select_entries``; quantised: only the chosen entries, dequantised."""
        store = self.stores[name]
        if self.cache.kv_dtype == "fp32":
            return store.read(0, max(store.lengths, default=0), self.no_pad(store)), idx
        return self.gathered([store], idx, self.no_pad(store), idx)

    def keep_last(self, names: tuple[str, ...], keep: int) -> None:
        """Later reads start ``keep`` steps back; blocks wholly before that are freed."""
        self.keep = keep
        c = self.cache
        for name in names:
            store = self.stores[name]
            for row in range(len(store.tables)):
                store.drop_before(row, store.lengths[row] - keep)

    def select_rows(self, index: torch.Tensor) -> None:
        super().select_rows(index)
        for store in self.stores.values():
            store.select_rows(index.tolist())

    def tensors(self):
        return super().tensors() + [t for s in self.stores.values() for t in s.chunks + s.scales]

    def __getitem__(self, key):  # a stored time-axis tensor reads as the contiguous cache holds it
        if key in self.stores:
            start = 0 if self.keep is None else max(0, self.cache.seen - self.keep)
            return self.stores[key].read(start, self.cache.seen, self.cache.pad_or_zeros())
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        return key in self.stores or super().__contains__(key)


class PagedCache(InferenceCache):
    """``InferenceCache`` with paged (and optionally int8) time-axis states.

    block_size: tokens per block; kv_dtype: "fp32" (the values' own dtype), "int8" or "fp8"."""

    def __init__(self, batch_size: int, pad: torch.Tensor | None = None, *, block_size: int = 16,
                 kv_dtype: str = "fp32"):
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype={kv_dtype!r}: allowed: {', '.join(KV_DTYPES)}")
        if block_size < 1:
            raise ConfigError(f"block_size={block_size}: must be >= 1")
        super().__init__(batch_size, pad)
        self.block_size, self.kv_dtype = block_size, kv_dtype
        self.steps: int | None = None  # reserved time steps (``reserve``), None: blocks taken as rows grow

    def reserve(self, steps: int) -> None:
        """Reserve ``steps`` time steps (prompt + new tokens) of every row before the first forward:
        each time-axis store is then one pool with every row's blocks assigned
        (``reserved.ReservedBlockStore``), so a step reads and writes it by tensor arithmetic alone
        and a compiled decode step is one graph. Memory is that of the whole generation from the
        start, as a contiguous cache's at its end."""
        if self._layers:
            raise ConfigError("cache.reserve: after the first forward (reserve before the prefill)")
        if steps < 1:
            raise ConfigError(f"cache.reserve: steps={steps} must be >= 1")
        self.steps = steps

    def tile_span(self, start: int, end: int) -> tuple[int, int]:
        """The steps a tiled read covers: [start, end) (an fp32 cache's one tile of symbolic size
        too), or for a quantised cache with reserved steps all of them [0, steps): a compiled step's
        tile loop cannot depend on the growing time axis (one graph for every step), so the
        readers mask (or cut off) the keys past end."""
        return (start, end) if self.steps is None or self.kv_dtype == "fp32" else (0, self.steps)

    def snapshot(self):
        """Blocks are written in place, so a paged cache cannot go back (speculative decoding
        decodes with the contiguous cache)."""
        raise ConfigError("a paged decode cache cannot be rolled back: speculative decoding needs the contiguous cache")

    def new_state(self, layer_number) -> LayerState:
        return PagedLayerState(self)

    def block_stores(self) -> list[BlockStore]:
        """Every layer's block stores (memory accounting)."""
        return [s for state in self._layers.values() for s in state.stores.values()]

    def kv_bytes(self) -> int:
        """Bytes of the blocks in use (values and scales) over every layer."""
        return sum(s.bytes_in_use() for s in self.block_stores())
