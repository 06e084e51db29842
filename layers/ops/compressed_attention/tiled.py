"""HCA's decoding attention with the entries arriving a tile at a time (a quantised decode cache
dequantising one tile of entries per read), so no more than a tile of entries is ever held at the
compute dtype.

The softmax over [window keys | entries | sink] runs online: a running maximum ``m`` (starting at
the head's sink logit, which every row's softmax contains, so ``m`` is always finite), sum ``l``
and weighted values ``o``; each block of logits (the window, then each entry tile)::

    m' = max(m, max(block))     l = l e^(m - m') + sum e^(block - m')     o = o e^(m - m') + e^(block - m') V
    out = o / l     (l counts the sink's e^(sink - m) from the start)

The reference is ``naive_compressed_attention`` with ``select=None`` (HCA); tests/test_paged_sparse.py
compares them on uneven tiles.
"""
from __future__ import annotations

from typing import Iterable

import torch

from megamoe.layers.ops.attention.context import allowed_mask
from megamoe.layers.ops.compressed_attention.naive import entry_mask
from megamoe.layers.ops.compressed_attention.pool import Entries


def _absorb(state, logits: torch.Tensor, values: torch.Tensor, eq: str):
    """(m, l, o) after one block of logits [b, H, s, n] over values (``eq`` contracts them)."""
    if logits.size(-1) == 0:  # an empty tile (no entries yet)
        return state
    m, l, o = state
    m_new = torch.maximum(m, logits.amax(-1))
    alpha, p = torch.exp(m - m_new), torch.exp(logits - m_new.unsqueeze(-1))
    return m_new, l * alpha + p.sum(-1), o * alpha.unsqueeze(-1) + torch.einsum(eq, p, values)


def tiled_entries_decode(q, kv, entry_tiles: Iterable, sinks, scale: float, *, window: int, q_start: int = 0,
                         kv_start: int = 0, q_doc=None, kv_doc=None) -> torch.Tensor:
    """q [b, s, H, D] at indices q_start + i, kv [b, T, D] (the window's keys, also the values) at
    kv_start + j, sinks [H]; entry_tiles: (values [b, n, D], end [b, n]) in order, each entry seen by
    the queries its block ended before -> [b, s, H, D] in q's dtype."""
    b, s, h, _ = q.shape
    qf = q.float()
    q_pos = torch.arange(q_start, q_start + s, device=q.device)
    kv_pos = torch.arange(kv_start, kv_start + kv.size(1), device=q.device)
    sink = sinks.float().view(1, h, 1).expand(b, h, s)
    state = sink, torch.ones_like(sink), qf.new_zeros(b, h, s, q.size(-1))
    logits = torch.einsum("bshd,btd->bhst", qf, kv.float()) * scale
    logits = logits.masked_fill(~allowed_mask(q_pos, kv_pos, window, q_doc, kv_doc)[:, None], float("-inf"))
    state = _absorb(state, logits, kv.float(), "bhst,btd->bhsd")
    for values, end in entry_tiles:
        logits = torch.einsum("bshd,bnd->bhsn", qf, values.float()) * scale
        seen = entry_mask(q_pos, Entries(values, end, None), None)  # [b, s, n]
        state = _absorb(state, logits.masked_fill(~seen[:, None], float("-inf")), values.float(), "bhsn,bnd->bhsd")
    _, l, o = state
    return (o / l.unsqueeze(-1)).transpose(1, 2).to(q.dtype)
