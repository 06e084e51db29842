"""DeepSeek-V4's compressed attention in query tiles: no [query x key] score matrix is held whole.

A tile of R queries scores only the keys its sliding window reaches (at most R + window - 1)
and its entries: the K the indexer selected for each query (CSA, gathered per tile) or every
entry (HCA, N = T / rate, masked by block end and document). Logits, the sink and the softmax
are fp32; the tile's function is checkpointed, so backward recomputes its scores from the
tile's inputs instead of keeping them (masks are rebuilt from positions, never stored). At most
``b H R (R + window - 1 + K)`` fp32 scores exist at a time, R = ``tile_size``: at most 2 window rows
and about 1024^2 scores (the window part of a tile is an R x (R + window - 1) block, most of it
inside the window when R is near the window).

Same contract as ``naive_compressed_attention`` (``naive.py``), which the tests hold it to.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megamoe.layers.ops.attention.context import allowed_mask, tile_rows
from megamoe.layers.ops.compressed_attention.naive import entry_mask
from megamoe.layers.ops.compressed_attention.pool import Entries


def _tile(q, kv, q_pos, kv_pos, q_doc, kv_doc, values, end, ent_doc, select, sinks, scale: float, window: int):
    """One tile: q [b, R, H, D] over kv [b, Tw, D] and the entries -> [b, R, H, D] fp32."""
    b, r, h, _ = q.shape
    qf = q.float()
    logits = torch.einsum("brhd,btd->bhrt", qf, kv.float()) * scale
    allowed = allowed_mask(q_pos, kv_pos, window, q_doc, kv_doc)  # [1|b, R, Tw]
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    parts, keys = [logits], None
    if values is not None:
        if select is not None:  # CSA: the selected entries of each query, gathered for this tile only
            keys = values[torch.arange(b, device=q.device)[:, None, None], select.clamp(min=0)].float()  # [b, R, K, D]
            ent = torch.einsum("brhd,brkd->bhrk", qf, keys) * scale
            ent = ent.masked_fill((select < 0)[:, None], float("-inf"))
        else:  # HCA: every entry, masked by block end and document
            keys = values.float()
            ent = torch.einsum("brhd,bnd->bhrn", qf, keys) * scale
            ent = ent.masked_fill(~entry_mask(q_pos, Entries(values, end, ent_doc), q_doc)[:, None], float("-inf"))
        parts.append(ent)
    logits = torch.cat(parts, dim=-1)
    sink = sinks.float().view(1, h, 1, 1)
    top = torch.maximum(logits.amax(-1, keepdim=True), sink)  # the sink keeps every row finite
    p = torch.exp(logits - top)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink - top)
    p = p / denom
    tw = kv.size(1)
    out = torch.einsum("bhrt,btd->brhd", p[..., :tw], kv.float())
    if keys is not None:
        eq = "bhrk,brkd->brhd" if select is not None else "bhrn,bnd->brhd"
        out = out + torch.einsum(eq, p[..., tw:], keys)
    return out


def tile_size(window: int, entry_keys: int) -> int:
    """Query rows per tile: a tile scores R x (R + window - 1) window keys (of which R x window are
    in a window) and R x K entries; R is at most 2 window (so at most a third of the window scores
    are wasted) and scores about TILE^2 pairs, at least 16 rows."""
    return max(16, min(2 * window, tile_rows(window + entry_keys)))


def chunk_compressed_attention(q, kv, entries: Entries | None, sinks, scale: float, *, window: int, q_start: int = 0,
                               kv_start: int = 0, q_doc=None, kv_doc=None, select=None, tile: int | None = None):
    """q [b, s, H, D] at indices q_start + i, kv [b, T, D] at kv_start + j (both contiguous on
    one axis), entries, sinks [H] -> [b, s, H, D]; ``select`` [b, s, K] (CSA) or None (HCA, or W
    without entries). ``tile``: query rows per tile (default: about 1024^2 scores a tile)."""
    b, s = q.shape[:2]
    entry_keys = 0 if entries is None else select.size(-1) if select is not None else entries.values.size(1)
    rows = tile or tile_size(window, entry_keys)
    values, end, ent_doc = (None, None, None) if entries is None else entries
    outs = []
    for a in range(0, s, rows):
        e = min(s, a + rows)
        q_pos = torch.arange(q_start + a, q_start + e, device=q.device)
        lo = max(0, q_start + a - window + 1 - kv_start)  # the keys this tile's windows reach
        hi = min(kv.size(1), q_start + e - kv_start)
        kv_pos = torch.arange(kv_start + lo, kv_start + hi, device=q.device)
        args = (q[:, a:e], kv[:, lo:hi], q_pos, kv_pos, None if q_doc is None else q_doc[:, a:e],
                None if kv_doc is None else kv_doc[:, lo:hi], values, end, ent_doc,
                None if select is None else select[:, a:e], sinks, scale, window)
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, kv, values, sinks))
        outs.append(checkpoint(_tile, *args, use_reentrant=False) if grad else _tile(*args))
    return torch.cat(outs, dim=1).to(q.dtype)
