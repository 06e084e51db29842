"""Decoding attention over keys that arrive one tile at a time (a quantised paged cache
dequantising one tile of blocks per step), so no more than a tile of keys and values is ever
materialised at the compute dtype.

Online softmax (as flash attention): per query and head a running max ``m``, normaliser ``l``
and weighted sum ``acc``; each tile's scores ``s`` update them as

    m' = max(m, max s)    l' = l e^(m - m') + sum e^(s - m')    acc' = acc e^(m - m') + e^(s - m') V

and the result is acc / l: the softmax over every key, whatever the tiling. The references are
``CoreAttention`` (softmax attention) and ``latent_attention`` (MLA's absorbed form) on all the
keys at once; ``tests/test_paged_cache.py`` compares them forward and backward.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


class OnlineSoftmax:
    """Softmax-weighted sums accumulated over key tiles. ``add(scores, weigh)``: ``scores``
    [..., n] fp32 (masked keys -inf), ``weigh(p)`` -> the tile's values weighted by ``p`` [..., n],
    summed over n: [..., dv]. ``result()`` -> [..., dv] (zeros where every key was masked)."""

    def __init__(self):
        self.m = self.l = self.acc = None

    def add(self, scores: torch.Tensor, weigh: Callable[[torch.Tensor], torch.Tensor]) -> None:
        m = scores.amax(-1) if self.m is None else torch.maximum(self.m, scores.amax(-1))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row masked so far: no shift
        p = torch.exp(scores - m.unsqueeze(-1))
        part = weigh(p)
        if self.m is None:
            self.l, self.acc = p.sum(-1), part
        else:
            c = torch.exp(self.m - m)
            self.l, self.acc = self.l * c + p.sum(-1), self.acc * c.unsqueeze(-1) + part
        self.m = m

    def result(self) -> torch.Tensor:
        return self.acc / self.l.clamp(min=torch.finfo(self.l.dtype).tiny).unsqueeze(-1)


def tiled_attention(q: torch.Tensor, tiles: Iterable, scale: float) -> torch.Tensor:
    """Softmax attention with GQA over key tiles.

    q [b, t, hq, d]; each tile (k [b, n, hk, d], v [b, n, hk, dv], mask [b, t, n] bool, True = may
    attend) -> [b, t, hq, dv] in q's dtype (scores and sums in fp32, as SDPA's CPU maths)."""
    b, t, hq, d = q.shape
    qf = None
    acc = OnlineSoftmax()
    for k, v, mask in tiles:
        hk = k.size(2)
        if qf is None:
            qf = q.float().view(b, t, hk, hq // hk, d)
        s = torch.einsum("btkgd,bnkd->bkgtn", qf, k.float()) * scale  # [b, hk, g, t, n]
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
        acc.add(s, lambda p, v=v: torch.einsum("bkgtn,bnkd->bkgtd", p, v.float()))
    out = acc.result()  # [b, hk, g, t, dv]
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, hq, -1).to(q.dtype)


def tiled_latent_attention_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, tiles: Iterable,
                                  scale: float) -> torch.Tensor:
    """MLA's absorbed attention (``latent_attention``) over latent tiles.

    q_lat [b, s, H, r], q_rope [b, s, H, dr]; each tile (c [b, n, r], k_rope [b, n, dr], mask
    [b, s, n]) -> [b, s, H, r] in c's dtype."""
    acc, dtype = OnlineSoftmax(), None
    for c, k_rope, mask in tiles:
        dtype = c.dtype
        s = (torch.einsum("bshr,btr->bsht", q_lat, c) + torch.einsum("bshd,btd->bsht", q_rope, k_rope)).float() * scale
        s = s.masked_fill(~mask.unsqueeze(2), float("-inf"))
        acc.add(s, lambda p, c=c: torch.einsum("bsht,btr->bshr", p, c.float()))
    return acc.result().to(dtype)
