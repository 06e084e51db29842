"""Compression blocks and their gated pooling (DeepSeek-V4 CSA / HCA).

A compressed entry stands for a block of ``rate`` consecutive tokens of one document, the
block starting at a position (within its document) that is a multiple of ``rate``. Each token
brings projected rows ``kv`` and ``gate``; the entry is, per channel, the softmax-over-the-block
of ``gate + position_bias`` weighting ``kv``::

    HCA (overlap off):  e_w[c] = sum_{j in block w} softmax_j(gate_j[c] + B_j[c]) kv_j[c]
    CSA (overlap on):   rows carry two series [Ca | Cb] of D channels each; e_w pools 2*rate
                        slots: block w-1's Ca (if that block is in the same document) and block
                        w's Cb, one softmax over the 2*rate slots per channel.

The pooling works on a *segment* of rows (a whole sequence, a cache's pending rows followed by
new ones, or a context-parallel chunk after the rows before it): only blocks complete in the
segment are pooled, and of those only the ones whose last row is at or after ``first_end``
(the ones not pooled before). ``p`` [b, T] gives each row's position in its document (-1: a
padding slot, in no document), so packed documents and left padding cut blocks the way a
document run alone does.

Shapes: rows [b, T, W] (W = D, or 2D with overlap), position_bias [rate, W], blocks [b, N]
(N = T // rate, the most a row can hold; rows with fewer have empty slots), entries [b, N, D].
"""
from __future__ import annotations

from typing import NamedTuple

import torch

EMPTY = 2 ** 62  # the end index of an empty entry slot: no query ever sees it


class Blocks(NamedTuple):
    """Complete blocks of a segment, per row in order. start: the first row's index in the
    segment (0 in empty slots); valid: a block in the slot; prev: the block before it (same
    document) lies in the segment (CSA's overlap); pos: its first token's position in its
    document (the entry's RoPE position). All [b, N]."""

    start: torch.Tensor
    valid: torch.Tensor
    prev: torch.Tensor
    pos: torch.Tensor


class Entries(NamedTuple):
    """Compressed entries as the attention reads them. values [b, N, D]; end [b, N] long: the
    index of the block's last token on the queries' axis (``EMPTY`` in an empty slot); doc
    [b, N] the block's document (None: one document per row)."""

    values: torch.Tensor
    end: torch.Tensor
    doc: torch.Tensor | None = None


def find_blocks(p: torch.Tensor, rate: int, first_end: int = 0) -> Blocks:
    """p [b, T] positions in the document (-1: no document) -> the complete blocks whose last
    row index is >= ``first_end``."""
    b, t = p.shape
    idx = torch.arange(t, device=p.device)
    last = idx + rate - 1
    ok = (p >= 0) & (p % rate == 0) & (last < t) & (last >= first_end)
    ok &= p.gather(1, last.clamp(max=t - 1).expand(b, -1)) == p + rate - 1  # no document starts inside
    counts = ok.sum(1)
    n = t // rate  # blocks are disjoint: a static bound (no data-dependent size, so it traces on fake tensors)
    order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices[:, :n]  # block starts first, in order
    valid = torch.arange(n, device=p.device) < counts[:, None]
    start = torch.where(valid, order, 0)
    pos = torch.where(valid, p.gather(1, start), 0)
    prev = valid & (pos >= rate) & (start >= rate)
    return Blocks(start, valid, prev, pos)


def pool_blocks(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, blocks: Blocks, rate: int,
                overlap: bool) -> torch.Tensor:
    """kv, gate [b, T, W], bias [rate, W] -> the blocks' pooled entries [b, N, D] (before the
    entry norm and RoPE; zeros in empty slots). Softmax in fp32, the weighted sum in kv's dtype."""
    b, n = blocks.start.shape
    rows = blocks.start[..., None] + torch.arange(rate, device=kv.device)  # [b, N, rate]
    batch = torch.arange(b, device=kv.device)[:, None, None]
    kv_blk, gate_blk = kv[batch, rows], gate[batch, rows] + bias  # [b, N, rate, W]
    if overlap:
        d = kv.size(-1) // 2
        before = (rows - rate).clamp(min=0)
        kv_prev, gate_prev = kv[batch, before, :d], gate[batch, before, :d] + bias[:, :d]
        gate_prev = gate_prev.masked_fill(~blocks.prev[..., None, None], float("-inf"))
        kv_blk = torch.cat([kv_prev, kv_blk[..., d:]], dim=2)  # [b, N, 2 rate, D]
        gate_blk = torch.cat([gate_prev, gate_blk[..., d:]], dim=2)
    weights = torch.softmax(gate_blk.float(), dim=2).to(kv.dtype)
    pooled = (kv_blk * weights).sum(dim=2)
    return pooled * blocks.valid[..., None].to(pooled.dtype)
