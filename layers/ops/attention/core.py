"""Causal softmax attention (GQA, sliding window): the core both backends' roles return."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.layers.ops.attention.context import check_documents, halo_fits, halo_window_attention, ring_attention
from megamoe.layers.ops.attention.tiles import MATH


def causal_mask(t_q: int, t_k: int, window: int = 0, device=None) -> torch.Tensor:
    """[t_q, t_k] bool, True = may attend. Queries are the last t_q of the t_k positions;
    ``window`` > 0 limits each query to the last ``window`` keys (itself included)."""
    q = torch.arange(t_k - t_q, t_k, device=device).unsqueeze(1)
    k = torch.arange(t_k, device=device).unsqueeze(0)
    allowed = k <= q
    if window > 0:
        allowed &= k > q - window
    return allowed


class CoreAttention(nn.Module):
    """Causal softmax attention with GQA and an optional sliding window.

    q: [b, t, hq, d], k: [b, tk, hk, d], v: [b, tk, hk, dv] -> [b, t, hq, dv]; tk >= t and the
    queries are the last t positions (decoding with a cache). ``tiles``: the kernel ring
    attention runs per tile under CP (``megamoe.layers.ops.attention.tiles``).
    """

    def __init__(self, softmax_scale: float, window: int = 0, tiles=MATH):
        super().__init__()
        self.scale, self.window, self.tiles = softmax_scale, window, tiles

    def forward(self, q, k, v, mask: torch.Tensor | None = None, *, cp=None, documents=None):
        """``cp`` (a ``ContextShard`` of more than one rank): q, k, v hold this rank's two chunks and
        the keys of the whole sequence are reached by ring attention (or, for a sliding window
        that reaches at most one chunk back, by a halo exchange). ``documents`` [b, S] (global
        order): packed documents, no query sees another document's keys."""
        check_documents(documents, q.size(0), cp.seq_len if cp is not None else k.size(1))
        if cp is not None and cp.size > 1:
            if halo_fits(self.window, cp):  # 'S' whose window stays within one chunk back
                return halo_window_attention(self, q, k, v, self.window, cp, documents)
            return ring_attention(q, k, v, self.scale, self.window, cp, documents, kernel=self.tiles)
        if documents is not None and mask is None and q.size(1) == k.size(1):
            return self.packed(q, k, v, documents)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, t, d]
        t, tk = q.size(2), k.size(2)
        gqa = q.size(1) != k.size(1)
        if mask is None and self.window == 0 and t == tk:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            if mask is None:
                mask = causal_mask(t, tk, self.window, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return out.transpose(1, 2)

    def packed(self, q, k, v, documents: torch.Tensor) -> torch.Tensor:
        """Each document of each row attended on its own (causal inside it): exactly the documents
        run one by one, through the fused kernel, and no [s, s] mask is built."""
        rows = []
        for r in range(q.size(0)):
            _, lengths = torch.unique_consecutive(documents[r], return_counts=True)
            spans = torch.cumsum(lengths, 0).tolist()
            rows.append(torch.cat([self(q[r:r + 1, a:e], k[r:r + 1, a:e], v[r:r + 1, a:e])
                                   for a, e in zip([0] + spans[:-1], spans)], dim=1))
        return torch.cat(rows, dim=0)
