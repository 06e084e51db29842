"""The lightning indexer's scoring and top-k, shared by every indexed attention: DSA (letters
D, I; ``megamoe.layers.mixers.dsa``) and MiniMax-M3's block-pooled indexer (letter B;
``megamoe.layers.mixers.block_sparse``).

An indexer has light query heads q_h and one key per token k; per query and key::

    per head:  s_h = scale * q_h . k                       (M3: scale 1, no activation)
    summed:    s   = sum_h w_h * relu(scale * q_h . k)     (DSA: scale Di^-1/2, w from x)

``select_topk`` keeps each query's best valid candidates, ties to the earlier candidate (a
stable sort), so a query's selection does not depend on how many later keys a pass holds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lightning_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor | None = None, *,
                     scale: float = 1.0, relu: bool = False) -> torch.Tensor:
    """q [b, s, H, D], keys [b, N, D] -> fp32 per-head scores [b, s, H, N], or with head
    weights [b, s, H] their weighted sum [b, s, N] (module docstring)."""
    per_head = torch.einsum("bshd,bnd->bshn", q.float(), keys.float())
    if scale != 1.0:
        per_head = per_head * scale
    if relu:
        per_head = F.relu(per_head)
    return per_head if weights is None else torch.einsum("bsh,bshn->bsn", weights.float(), per_head)


def select_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """scores, valid [..., N] -> indices [..., min(k, N)] of the best valid candidates, -1 where
    fewer are valid. Ties go to the lower index (stable sort)."""
    k = min(k, scores.size(-1))
    scores = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.masked_fill(~valid.gather(-1, order), -1)
