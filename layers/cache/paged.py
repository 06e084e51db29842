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
float8 e4m3 values (scale = amax / 448; torch casts to it on CPU too). A block still filling is re-quantised when
tokens arrive (its scale can only grow), so every stored value stays within half a step of
the latest scale.
"""
from __future__ import annotations

import torch

from megamoe.layers.cache.decode import InferenceCache, LayerState
from megamoe.core.errors import ConfigError

KV_DTYPES = ("fp32", "int8", "fp8")  # fp32: the values' own dtype; fp8: e4m3
STORAGE = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}  # stored dtype, largest value


class BlockStore:
    """One time-axis tensor of one layer for every sequence of the batch.

    Block 0 is a zero block never handed out: table entries of freed blocks and padded slots
    read from it."""

    def __init__(self, rows: int, block_size: int, feature: tuple[int, ...], dtype: torch.dtype, device,
                 quantized: str | None):
        if not (len(feature) > 0 and min(feature) > 0):
            quantized = None  # an empty feature (no RoPE part) stays as it is
        self.block, self.feature, self.dtype, self.quantized = block_size, feature, dtype, quantized
        stored = STORAGE[quantized][0] if quantized else dtype
        self.pool = torch.zeros(1, block_size, *feature, dtype=stored, device=device)
        self.scale = torch.zeros(1, *feature[:-1], dtype=torch.float32, device=device) if quantized else None
        self.free: list[int] = []
        self.tables: list[list[int]] = [[] for _ in range(rows)]  # block ids per sequence, 0 = freed
        self.lengths = [0] * rows  # tokens stored per sequence

    # ---- blocks ---------------------------------------------------------------------------

    def blocks_in_use(self) -> int:
        return sum(1 for table in self.tables for b in table if b)

    def bytes_in_use(self) -> int:
        per_block = self.pool[0].numel() * self.pool.element_size()
        if self.quantized:
            per_block += self.scale[0].numel() * self.scale.element_size()
        return self.blocks_in_use() * per_block

    def take(self) -> int:
        if not self.free:  # grow the pool by as many blocks as it has (at least 4)
            n = self.pool.size(0)
            grow = max(4, n)
            self.pool = torch.cat([self.pool, self.pool.new_zeros(grow, *self.pool.shape[1:])])
            if self.quantized:
                self.scale = torch.cat([self.scale, self.scale.new_zeros(grow, *self.scale.shape[1:])])
            self.free = list(range(n + grow - 1, n - 1, -1))
        return self.free.pop()

    def release(self, block: int) -> None:
        if block:
            self.pool[block].zero_()
            if self.quantized:
                self.scale[block].zero_()
            self.free.append(block)

    def select_rows(self, index: list[int]) -> None:
        kept = set(index)
        for row, table in enumerate(self.tables):
            if row not in kept:
                for block in table:
                    self.release(block)
        self.tables = [self.tables[i] for i in index]
        self.lengths = [self.lengths[i] for i in index]

    def drop_before(self, row: int, position: int) -> None:
        """Free the blocks of ``row`` holding only positions < ``position``."""
        table = self.tables[row]
        for i in range(min(len(table), max(0, position) // self.block)):
            self.release(table[i])
            table[i] = 0

    # ---- values ---------------------------------------------------------------------------

    def append(self, x: torch.Tensor, valid: torch.Tensor) -> None:
        """x [b, t, *feature]; valid [b, t] bool (left padding False): the real tokens follow
        each sequence's stored ones."""
        rows, cols = valid.nonzero(as_tuple=True)
        if rows.numel() == 0:
            return
        slots = []
        for r in rows.tolist():  # one position per new token, blocks taken as sequences grow
            pos = self.lengths[r]
            if pos % self.block == 0:
                self.tables[r].append(self.take())
            slots.append((self.tables[r][pos // self.block], pos % self.block))
            self.lengths[r] = pos + 1
        block_ids = torch.tensor([b for b, _ in slots], device=x.device)
        offsets = torch.tensor([o for _, o in slots], device=x.device)
        values = x[rows, cols].detach()
        if not self.quantized:
            self.pool[block_ids, offsets] = values.to(self.pool.dtype)
            return
        touched, local = torch.unique(block_ids, return_inverse=True)
        buf = self.dequantize(touched)  # [n, B, *feature] fp32
        buf[local, offsets] = values.float()
        self.pool[touched], self.scale[touched] = quantize(buf, self.quantized)

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        return self.pool[blocks].float() * self.scale[blocks].unsqueeze(1).unsqueeze(-1)

    def read(self, start: int, end: int, pad: torch.Tensor) -> torch.Tensor:
        """Time steps [start, end) of the batch's common time axis -> [b, end - start, *feature];
        row r's step t is its position t - pad[r] (zeros where that is < 0 or freed)."""
        b = len(self.tables)
        pos = torch.arange(start, end)[None, :] - pad.cpu()[:, None]  # [b, T]
        width = max([len(t) for t in self.tables] + [1])
        table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.long).view(b, width)
        blocks = table.gather(1, (pos.clamp(min=0) // self.block).clamp(max=width - 1))
        blocks = torch.where(pos >= 0, blocks, 0).to(self.pool.device)
        offsets = (pos.clamp(min=0) % self.block).to(self.pool.device)
        if not self.quantized:
            return self.pool[blocks, offsets]
        values = self.pool[blocks, offsets].float() * self.scale[blocks].unsqueeze(-1)
        return values.to(self.dtype)


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, B, *feature] fp32 -> ``kind`` ("int8" | "fp8") values and scales [n, *feature[:-1]]
    (one per block and leading feature dims: per head for [h, d]); symmetric, amax / largest."""
    stored, largest = STORAGE[kind]
    amax = x.abs().amax(dim=(1, -1))
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    y = (x / scale.unsqueeze(1).unsqueeze(-1)).clamp(-largest, largest)
    q = (torch.round(y) if kind == "int8" else y).to(stored)
    return q, torch.where(amax > 0, scale, torch.zeros_like(scale))


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
