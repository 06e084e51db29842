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
Softmax attention (A, S) and MLA's latents (M) read a quantised cache ``TILE_TOKENS`` steps at
a time (``attend_kv``/``attend_latent``: a tile kernel per tile, merged by log-sum-exp), so decode memory grows
with the quantised bytes; other readers (DSA's selected-key attention and indexer keys, the
block-sparse layers, DeepSeek-V4's compressed entries) still get the dequantised whole through
``append_time``.
"""
from __future__ import annotations

import torch

from megamoe.core.errors import ConfigError
from megamoe.layers.cache.blocks import BlockStore
from megamoe.layers.cache.decode import InferenceCache, LayerState
from megamoe.layers.ops.attention.core import causal_mask
from megamoe.layers.ops.attention.tiled import tiled_attention, tiled_latent_attention_decode

KV_DTYPES = ("fp32", "int8", "fp8")  # fp32: the values' own dtype; fp8: e4m3
TILE_TOKENS = 512  # time steps a quantised cache dequantises at once when attention reads it


class PagedLayerState(LayerState):
    """A mixer's state whose time-axis tensors live in ``BlockStore``s of its cache."""

    def __init__(self, cache: "PagedCache"):
        super().__init__()
        self.cache = cache
        self.stores: dict[str, BlockStore] = {}
        self.keep: int | None = None  # sliding window: time steps kept after each forward

    def store(self, name: str, x: torch.Tensor) -> BlockStore:
        """The block store of ``name`` (made for ``x``'s features and dtype on first use)."""
        c = self.cache
        if name not in self.stores:
            self.stores[name] = BlockStore(c.batch_size, c.block_size, tuple(x.shape[2:]), x.dtype, x.device,
                                           None if c.kv_dtype == "fp32" else c.kv_dtype)
        return self.stores[name]

    def append_time(self, name: str, x: torch.Tensor) -> torch.Tensor:
        c = self.cache
        store = self.store(name, x)
        t = x.size(1)
        valid = c.valid(t, x.device)
        store.append(x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if valid is None else valid)
        start = 0 if self.keep is None else max(0, c.seen - self.keep)
        return store.read(start, c.seen + t, c.pad_or_zeros())

    def attend_kv(self, cache, q, k, v, core, window: int = 0) -> torch.Tensor:
        """``LayerState.attend_kv``; a quantised cache dequantises one tile of keys and values at a
        time (``tiled_attention``: the core's tile kernel, tiles merged by their log-sum-exps), never the whole history."""
        if cache.kv_dtype == "fp32":
            return super().attend_kv(cache, q, k, v, core, window)
        return tiled_attention(q, self.tiles({"k": k, "v": v}, q.size(1), window), core.scale, core.tiles)

    def attend_latent(self, cache, q_lat, q_rope, c, k_rope, core, scale: float) -> torch.Tensor:
        """``LayerState.attend_latent``; quantised: one tile of latents at a time."""
        if cache.kv_dtype == "fp32":
            return super().attend_latent(cache, q_lat, q_rope, c, k_rope, core, scale)
        return tiled_latent_attention_decode(q_lat, q_rope, self.tiles({"c": c, "k_rope": k_rope}, q_lat.size(1)),
                                             scale)

    def tiles(self, new: dict[str, torch.Tensor], t_q: int, window: int = 0):
        """Append ``new`` (name -> [b, t_q, ...]), then yield the kept time axis ``TILE_TOKENS`` steps
        at a time: (each name's steps [b, n, ...] dequantised, mask [b or 1, t_q, n])."""
        c = self.cache
        for name, x in new.items():
            valid = c.valid(t_q, x.device)
            self.store(name, x).append(x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
                                       if valid is None else valid)
        device = next(iter(new.values())).device
        start, end = (0 if self.keep is None else max(0, c.seen - self.keep)), c.seen + t_q
        mask = c.attention_mask(t_q, end - start, window, device)
        mask = causal_mask(t_q, end - start, window, device)[None] if mask is None else mask
        pad = c.pad_or_zeros()
        for a in range(start, end, TILE_TOKENS):
            e = min(end, a + TILE_TOKENS)
            yield (*(self.stores[name].read(a, e, pad) for name in new), mask[..., a - start:e - start])

    def append_entries(self, name: str, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``LayerState.append_entries`` in blocks: each row's entries follow its stored ones (their
        own axis), read back right-padded with zeros, as the contiguous cache gives them."""
        store = self.store(name, x)
        store.append(x, valid)
        counts = torch.tensor(store.lengths, dtype=torch.long, device=x.device)
        width = int(counts.max()) if counts.numel() else 0
        return store.read(0, width, torch.zeros(len(store.lengths), dtype=torch.long)), counts

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

    def snapshot(self):
        """Blocks are written in place, so a paged cache cannot go back (speculative decoding
        decodes with the contiguous cache)."""
        raise ConfigError("a paged decode cache cannot be rolled back: speculative decoding needs the contiguous cache")

    def new_state(self, layer_number) -> LayerState:
        return PagedLayerState(self)

    def pad_or_zeros(self) -> torch.Tensor:
        return self.pad if self.pad is not None else torch.zeros(self.batch_size, dtype=torch.long)

    def kv_bytes(self) -> int:
        """Bytes of the blocks in use (values and scales) over every layer."""
        return sum(s.bytes_in_use() for state in self._layers.values() for s in state.stores.values())
