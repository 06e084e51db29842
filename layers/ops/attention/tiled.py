"""Decoding attention over keys that arrive one tile at a time (a quantised paged cache
dequantising one tile of blocks per step), so no more than a tile of keys and values is ever
materialised at the compute dtype.

Each tile runs a tile kernel (``tiles.py``: the tile's output and log-sum-exp, the backend's for
softmax attention, the math reference for MLA's latents), and tiles merge by their
log-sum-exps, as ring attention's chunks do:

    lse = log(e^lse_a + e^lse_b)    out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b

so the result is the softmax over every key, whatever the tiling. The references are
``CoreAttention`` and ``latent_attention`` on all the keys at once; ``tests/test_paged_cache.py``
compares them forward and backward.
"""
from __future__ import annotations

from typing import Iterable

import torch

from megamoe.layers.ops.attention.tiles import MATH


def merge(acc, part):
    """Two key sets' (out [b, H, n, dv], lse [b, H, n]) -> theirs together (None: nothing yet;
    a query masked in both keeps out 0 and lse -inf)."""
    if acc is None:
        return part
    (out_a, lse_a), (out_b, lse_b) = acc, part
    lse = torch.logaddexp(lse_a, lse_b)
    shift = torch.where(torch.isinf(lse), 0.0, lse)
    out = out_a * torch.exp(lse_a - shift).unsqueeze(-1) + out_b * torch.exp(lse_b - shift).unsqueeze(-1)
    return out, lse


def tiled_attention(q: torch.Tensor, tiles: Iterable, scale: float, kernel=MATH) -> torch.Tensor:
    """Softmax attention with GQA over key tiles: q [b, t, hq, d]; each tile (k [b, n, hk, d],
    v [b, n, hk, dv], mask [1|b, t, n] bool, True = may attend) -> [b, t, hq, dv] in q's dtype."""
    qh, acc = q.transpose(1, 2), None
    for k, v, mask in tiles:
        acc = merge(acc, kernel.forward(qh, k.transpose(1, 2), v.transpose(1, 2), scale, False, mask.unsqueeze(1)))
    return acc[0].transpose(1, 2).to(q.dtype)


def tiled_latent_attention_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, tiles: Iterable,
                                  scale: float) -> torch.Tensor:
    """MLA's absorbed attention (``latent_attention``) over latent tiles: one key head shared by
    every query head, keys (c, k_rope), values c. q_lat [b, s, H, r], q_rope [b, s, H, dr]; each
    tile (c [b, n, r], k_rope [b, n, dr], mask [1|b, s, n]) -> [b, s, H, r] in c's dtype."""
    q, acc, dtype = torch.cat([q_lat, q_rope], -1).transpose(1, 2), None, q_lat.dtype
    for c, k_rope, mask in tiles:
        k = torch.cat([c, k_rope], -1).unsqueeze(1)  # [b, 1, n, r + dr]
        acc, dtype = merge(acc, MATH.forward(q, k, c.unsqueeze(1), scale, False, mask.unsqueeze(1))), c.dtype
    return acc[0].transpose(1, 2).to(dtype)
