"""A block store whose whole time axis is reserved up front (``PagedCache.reserve``): the store a
compiled decode step reads and writes inside its one graph.

``BlockStore`` takes blocks from a free list as sequences grow and keeps its block tables as
python lists: host bookkeeping a compiled graph cannot hold (every step would break the graph
there, and the pool's chunk list changes length as it grows). Here the pool is one chunk sized
for the generation (prompt + new tokens, as vLLM sizes its pool before the first step) and
each row's blocks are assigned when the store is made, so a step's writes and reads are tensor
arithmetic on the fixed block table ``[b, width]``:

    position p = t - pad[r]    block = table[r, p // B]    offset = p % B

Left-padding slots (p < 0) read the zero block (0) and write into a sink block (1) nothing
reads. Blocks are never freed while the cache lives (a sliding window's old blocks stay
reserved; readers start at the window); rows leaving the batch return theirs.
"""
from __future__ import annotations

import torch

from megamoe.core.errors import ConfigError
from megamoe.layers.cache.blocks import BlockStore, quantize

SINK = 1  # the block padding slots write into; never read


class ReservedBlockStore(BlockStore):
    """``BlockStore`` with ``steps`` time steps of every row reserved (rows left-padded by ``pad``)."""

    def __init__(self, rows: int, block_size: int, feature: tuple[int, ...], dtype: torch.dtype, device,
                 quantized: str | None, pad: torch.Tensor, steps: int):
        need = [-(-max(0, steps - int(p)) // block_size) for p in pad.tolist()]  # blocks per row
        super().__init__(rows, block_size, feature, dtype, device, quantized, chunk_blocks=2 + sum(need))
        self.steps = steps
        self.free.remove(SINK)
        self.tables = [[self.take() for _ in range(n)] for n in need]

    def table(self) -> torch.Tensor:
        """The block tables [b, width] on the store's device (rebuilt only when rows leave)."""
        if self._table is None:
            self._table = super().table().to(self.device)
        return self._table

    def locate(self, times: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``BlockStore.locate`` by tensor arithmetic on the device (nothing read on the host)."""
        pos = times.to(self.device) - pad.to(self.device).view(-1, *[1] * (times.dim() - 1))
        table = self.table()
        at = (pos.clamp(min=0) // self.block).clamp(max=table.size(1) - 1)
        blocks = torch.where(pos >= 0, table.gather(1, at.flatten(1)).view_as(pos), 0)
        return blocks, pos.clamp(min=0) % self.block

    def append(self, x: torch.Tensor, valid: torch.Tensor) -> None:
        raise TypeError("a reserved block store places tokens by position: append_at")

    def append_at(self, x: torch.Tensor, valid, start: int, pad: torch.Tensor) -> None:
        """x [b, t, *feature] at time steps [start, start + t); ``valid`` is implied by ``pad``."""
        if start + x.size(1) > self.steps:
            raise ConfigError(f"paged cache: {start + x.size(1)} time steps, past the {self.steps} reserved")
        times = torch.arange(start, start + x.size(1), device=self.device)[None, :].expand(x.size(0), -1)
        blocks, offsets = self.locate(times, pad)                                     # [b, t]
        blocks = torch.where(blocks == 0, SINK, blocks)  # padding slots (every real one has its block)
        x = x.detach().to(self.device)
        if x.size(1) == 1 and self.quantized:  # a decode step: one block per row, rows' blocks distinct
            self.requantize(blocks[:, 0], offsets[:, 0], x[:, 0])
        else:
            self.write(blocks.flatten(), offsets.flatten(), x.flatten(0, 1))

    def requantize(self, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        """``write`` for distinct blocks [n] (the sink aside), without ``torch.unique``'s
        data-dependent shape: each block dequantised, its token set, quantised again."""
        buf = self.dequantize(blocks)                                                  # [n, B, *feature]
        buf[torch.arange(blocks.size(0), device=blocks.device), offsets] = values.float()
        q, scale = quantize(buf, self.quantized)
        self._scatter(self.chunks, blocks, q)
        self._scatter(self.scales, blocks, scale)

    def drop_before(self, row: int, position: int) -> None:
        """Nothing: reserved blocks stay until their row leaves (readers start at the window)."""
