"""References for DeepSeek-V4's compressed attention: plain tensors, whole score matrices.

``naive_compress``: the entries of ONE document as transformers computes them (windows of
``rate`` rows reshaped, the CSA overlap laid out slot by slot), before the entry norm and RoPE.

``naive_compressed_attention``: every query against every window key and every entry at once,
one dense mask, the per-head sink logit in the softmax's denominator::

    logits = [q . kv_t * scale (t in the window) | q . e_n * scale (n allowed) | sink_h]
    o = softmax(logits)[:-1] . [kv | e]                            (keys are the values)

Shapes: q [b, s, H, D]; kv [b, T, D]; entries [b, N, D]; sinks [H]; -> [b, s, H, D].
"""
from __future__ import annotations

import torch

from megamoe.layers.ops.attention.context import allowed_mask
from megamoe.layers.mixers.dsa import indices_to_mask
from megamoe.layers.ops.compressed_attention.pool import Entries


def naive_compress(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, rate: int, overlap: bool) -> torch.Tensor:
    """kv, gate [b, T, W] of one document from its first token -> [b, T // rate, D]."""
    b, t, w = kv.shape
    n = t // rate
    kv, gate = kv[:, :n * rate].view(b, n, rate, w), gate[:, :n * rate].view(b, n, rate, w) + bias
    if overlap:
        d = w // 2
        slots_kv = kv.new_zeros(b, n, 2 * rate, d)
        slots_gate = gate.new_full((b, n, 2 * rate, d), float("-inf"))
        slots_kv[:, :, rate:], slots_gate[:, :, rate:] = kv[..., d:], gate[..., d:]
        slots_kv[:, 1:, :rate], slots_gate[:, 1:, :rate] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
        kv, gate = slots_kv, slots_gate
    return (kv * torch.softmax(gate.float(), dim=2).to(kv.dtype)).sum(dim=2)


def entry_mask(q_pos: torch.Tensor, entries: Entries, q_doc: torch.Tensor | None) -> torch.Tensor:
    """[b, s, N] True where the query at ``q_pos`` [s] sees the entry: its block ended at or
    before the query, in the query's document."""
    allowed = entries.end[:, None, :] <= q_pos[None, :, None]
    if entries.doc is not None and q_doc is not None:
        allowed = allowed & (entries.doc[:, None, :] == q_doc[:, :, None])
    return allowed


def naive_compressed_attention(q, kv, entries: Entries | None, sinks, scale: float, *, window: int, q_start: int = 0,
                               kv_start: int = 0, q_doc=None, kv_doc=None, select=None, tile=None):
    """The reference with ``chunk_compressed_attention``'s signature (``tile`` is ignored).

    Queries sit at indices q_start + i of one axis, keys at kv_start + j; key j is in query i's
    window when it is at most ``window - 1`` before it (and in its document, ``q_doc`` [b, s],
    ``kv_doc`` [b, T]). ``select`` [b, s, K]: the entries each query may see (-1: none; CSA);
    None: every entry that ended before the query in its document (HCA)."""
    b, s, h, _ = q.shape
    q_pos = torch.arange(q_start, q_start + s, device=q.device)
    kv_pos = torch.arange(kv_start, kv_start + kv.size(1), device=q.device)
    allowed = allowed_mask(q_pos, kv_pos, window, q_doc, kv_doc).expand(b, -1, -1)
    keys = kv
    if entries is not None:
        seen = entry_mask(q_pos, entries, q_doc) if select is None else indices_to_mask(select, entries.values.size(1))
        keys = torch.cat([kv, entries.values], dim=1)
        allowed = torch.cat([allowed, seen], dim=-1)
    logits = torch.einsum("bshd,btd->bhst", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    sink = sinks.float().view(1, h, 1, 1).expand(b, h, s, 1)
    p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhst,btd->bshd", p, keys.float()).to(q.dtype)
