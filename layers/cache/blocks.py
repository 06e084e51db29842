"""The paged cache's block pool: one time-axis tensor of one layer for every sequence of a batch,
in fixed-size blocks, optionally int8 or fp8 with one fp32 scale per block and head.

The pool is a list of chunks of ``C`` blocks ``[C, block_size, *feature]`` (``C``: as many blocks
as fit ``CHUNK_BYTES``, between 1 and ``CHUNK_BLOCKS``): it grows by one chunk at a time, never by
copying what it holds, so decode memory follows the stored bytes (a contiguous cache's
``torch.cat`` holds old and new at once on every step) and the unfilled part of the last chunk
stays under ``CHUNK_BYTES``. Block ``b`` is row ``b % C`` of chunk ``b // C``; block 0 is a zero
block never handed out: table entries of freed blocks and padded slots read from it.

Quantised (``quantized`` "int8" | "fp8"): scale = amax / largest over the block's tokens, per
block and leading feature dims (per head for [h, d] keys, one per block for a latent [r]). A block
still filling is re-quantised when tokens arrive (its scale can only grow), so every stored value
stays within half a step of the latest scale. ``read`` (a range of time steps) and ``gather``
(chosen steps, optionally one head each) dequantise only the steps asked for.
"""
from __future__ import annotations

import torch

STORAGE = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}  # stored dtype, largest value
CHUNK_BLOCKS = 64  # most blocks per pool chunk: the pool grows by a chunk (all rows share them)
CHUNK_BYTES = 64 << 10  # a chunk's values hold at most this many bytes (at least one block)


class BlockStore:
    """Blocks of ``feature``-shaped time steps; ``tables[r]``: row r's block ids in order."""

    def __init__(self, rows: int, block_size: int, feature: tuple[int, ...], dtype: torch.dtype, device,
                 quantized: str | None, chunk_blocks: int | None = None):
        if not (len(feature) > 0 and min(feature) > 0):
            quantized = None  # an empty feature (no RoPE part) stays as it is
        self.block, self.feature, self.dtype, self.quantized = block_size, feature, dtype, quantized
        self.stored = STORAGE[quantized][0] if quantized else dtype
        self.device = device
        per_block = block_size * int(torch.Size(feature).numel()) * self.stored.itemsize
        self.chunk_blocks = chunk_blocks or max(1, min(CHUNK_BLOCKS, CHUNK_BYTES // max(1, per_block)))
        self._table: torch.Tensor | None = None  # the tables as one [b, width] tensor, until they change
        self.chunks: list[torch.Tensor] = []  # [C, block, *feature] values
        self.scales: list[torch.Tensor] = []  # [C, *feature[:-1]] fp32 (quantised only)
        self.free: list[int] = []
        self._grow()
        self.free.remove(0)  # block 0: the zero block
        self.tables: list[list[int]] = [[] for _ in range(rows)]  # block ids per sequence, 0 = freed
        self.lengths = [0] * rows  # tokens stored per sequence

    # ---- blocks ---------------------------------------------------------------------------

    def _grow(self) -> None:
        c = self.chunk_blocks
        n = len(self.chunks) * c
        self.chunks.append(torch.zeros(c, self.block, *self.feature, dtype=self.stored, device=self.device))
        if self.quantized:
            self.scales.append(torch.zeros(c, *self.feature[:-1], dtype=torch.float32, device=self.device))
        self.free.extend(range(n + c - 1, n - 1, -1))

    def blocks_in_use(self) -> int:
        return sum(1 for table in self.tables for b in table if b)

    def bytes_in_use(self) -> int:
        per_block = self.chunks[0][0].numel() * self.chunks[0].element_size()
        if self.quantized:
            per_block += self.scales[0][0].numel() * self.scales[0].element_size()
        return self.blocks_in_use() * per_block

    def take(self) -> int:
        if not self.free:
            self._grow()
        return self.free.pop()

    def release(self, block: int) -> None:
        if block:
            c = self.chunk_blocks
            self.chunks[block // c][block % c].zero_()
            if self.quantized:
                self.scales[block // c][block % c].zero_()
            self.free.append(block)
            self._table = None

    def select_rows(self, index: list[int]) -> None:
        kept = set(index)
        for row, table in enumerate(self.tables):
            if row not in kept:
                for block in table:
                    self.release(block)
        self.tables = [self.tables[i] for i in index]
        self.lengths = [self.lengths[i] for i in index]
        self._table = None

    def drop_before(self, row: int, position: int) -> None:
        """Free the blocks of ``row`` holding only positions < ``position``."""
        table = self.tables[row]
        for i in range(min(len(table), max(0, position) // self.block)):
            self.release(table[i])
            table[i] = 0
        self._table = None

    # ---- indexing over the chunks ----------------------------------------------------------

    def _gather(self, parts: list[torch.Tensor], blocks: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """``part[blocks % C, *rest]`` looked up in each block's chunk; shape blocks.shape + tail."""
        chunk, row = blocks // self.chunk_blocks, blocks % self.chunk_blocks
        if len(parts) == 1:
            return parts[0][(row, *rest)]
        out = parts[0].new_empty(*blocks.shape, *parts[0].shape[1 + len(rest):])
        for i in torch.unique(chunk).tolist():
            sel = chunk == i
            out[sel] = parts[i][(row[sel], *(r[sel] for r in rest))]
        return out

    def _scatter(self, parts: list[torch.Tensor], blocks: torch.Tensor, values: torch.Tensor, *rest) -> None:
        chunk, row = blocks // self.chunk_blocks, blocks % self.chunk_blocks
        if len(parts) == 1:
            parts[0][(row, *rest)] = values
            return
        for i in torch.unique(chunk).tolist():
            sel = chunk == i
            parts[i][(row[sel], *(r[sel] for r in rest))] = values[sel]

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
                self._table = None
            slots.append((self.tables[r][pos // self.block], pos % self.block))
            self.lengths[r] = pos + 1
        block_ids = torch.tensor([b for b, _ in slots], device=x.device)
        offsets = torch.tensor([o for _, o in slots], device=x.device)
        self.write(block_ids, offsets, x[rows, cols].detach())

    def write(self, block_ids: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        """values [n, *feature] into (block_ids, offsets) [n]; a quantised block is re-quantised
        whole with its new tokens (every touched block once)."""
        if not self.quantized:
            self._scatter(self.chunks, block_ids, values.to(self.stored), offsets)
            return
        touched, local = torch.unique(block_ids, return_inverse=True)
        buf = self.dequantize(touched)  # [n, B, *feature] fp32
        buf[local, offsets] = values.float()
        q, scale = quantize(buf, self.quantized)
        self._scatter(self.chunks, touched, q)
        self._scatter(self.scales, touched, scale)

    def append_at(self, x: torch.Tensor, valid: torch.Tensor, start: int, pad: torch.Tensor) -> None:
        """``append`` for a forward whose first step is ``start`` of the common time axis (rows
        left-padded by ``pad`` [b]); what a store with reserved blocks places by position."""
        self.append(x, valid)

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        return self._gather(self.chunks, blocks).float() * self._gather(self.scales, blocks).unsqueeze(1).unsqueeze(-1)

    def table(self) -> torch.Tensor:
        """The block tables as one [b, width] tensor (0 past a row's blocks), kept until they change."""
        if self._table is None:
            width = max([len(t) for t in self.tables] + [1])
            self._table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables],
                                       dtype=torch.long).view(len(self.tables), width)
        return self._table

    def locate(self, times: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Time steps ``times`` [b, ...] of the batch's common time axis -> (blocks, offsets) [b, ...]
        on the store's device; row r's step t is its position t - pad[r], and a position < 0 (left
        padding, or t = -1 for none) or past the row's blocks reads the zero block."""
        pos = times.cpu() - pad.cpu().view(-1, *[1] * (times.dim() - 1))
        table = self.table()
        at = (pos.clamp(min=0) // self.block).clamp(max=table.size(1) - 1)
        inside = (pos >= 0) & (pos // self.block < table.size(1))  # past a row's blocks: zeros too
        blocks = torch.where(inside, table.gather(1, at.flatten(1)).view_as(pos), 0)
        return blocks.to(self.device), (pos.clamp(min=0) % self.block).to(self.device)

    def fetch(self, blocks: torch.Tensor, offsets: torch.Tensor, *heads: torch.Tensor) -> torch.Tensor:
        """The values at (blocks, offsets[, heads]) [b, ...] -> [b, ..., *feature] (with heads: one
        leading feature index each, [b, ..., *feature[1:]]), dequantised in the values' dtype."""
        values = self._gather(self.chunks, blocks, offsets, *heads)
        if not self.quantized:
            return values
        scale = self._gather(self.scales, blocks, *heads).unsqueeze(-1)
        return values.float().mul_(scale).to(self.dtype)

    def read(self, start: int, end: int, pad: torch.Tensor) -> torch.Tensor:
        """Time steps [start, end) of the batch's common time axis -> [b, end - start, *feature];
        row r's step t is its position t - pad[r] (zeros where that is < 0 or freed). Quantised
        blocks are dequantised for these steps only."""
        times = torch.arange(start, end, device=self.device)[None, :].expand(len(self.tables), -1)
        return self.fetch(*self.locate(times, pad))

    def gather(self, times: torch.Tensor, pad: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """Chosen time steps ``times`` [b, ...] (-1: none, read as zeros) -> [b, ..., *feature]; with
        ``heads`` (same shape as times) step i reads only leading feature index heads[i] ->
        [b, ..., *feature[1:]]. Only the chosen steps are dequantised."""
        blocks, offsets = self.locate(times, pad)
        return self.fetch(blocks, offsets, *(() if heads is None else (heads.to(self.device),)))

def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, B, *feature] fp32 -> ``kind`` ("int8" | "fp8") values and scales [n, *feature[:-1]]
    (one per block and leading feature dims: per head for [h, d]); symmetric, amax / largest."""
    stored, largest = STORAGE[kind]
    amax = x.abs().amax(dim=(1, -1))
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    y = (x / scale.unsqueeze(1).unsqueeze(-1)).clamp(-largest, largest)
    q = (torch.round(y) if kind == "int8" else y).to(stored)
    return q, torch.where(amax > 0, scale, torch.zeros_like(scale))
