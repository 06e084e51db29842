"""Decoding attention over keys that arrive one tile at a time (a quantised paged cache
dequantising one tile of blocks per step), so no more than a tile of keys and values is ever
materialised at the compute dtype.

Each tile runs a tile kernel (``tiles.py``: the tile's output and log-sum-exp, the backend's for
softmax attention, the math reference for MLA's latents), and tiles merge by their
log-sum-exps, as ring attention's chunks do:

    lse = log(e^lse_a + e^lse_b)    out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b

so the result is the softmax over every key, whatever the tiling. ``partial_attention`` and
``partial_latent_attention`` stop before the last step and return (out, lse): decoding under
context parallelism (``megamoe.layers.cache.split``) merges them over the CP ranks' key sets. The references are
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


def partial_attention(q: torch.Tensor, tiles: Iterable, scale: float, kernel=MATH, dv: int | None = None):
    """Softmax attention with GQA over key tiles, not yet normalised across other key sets:
    q [b, t, hq, d]; each tile (k [b, n, hk, d], v [b, n, hk, dv], mask [1|b, t, n] bool, True = may
    attend, or None: every key) -> (out fp32 [b, hq, t, dv], lse fp32 [b, hq, t]), ready to ``merge``
    with another key set's. No tile (``dv`` given): out 0 and lse -inf, which merges as nothing."""
    qh, acc = q.transpose(1, 2), None
    for k, v, mask in tiles:
        mask = None if mask is None else mask.unsqueeze(1)
        acc = merge(acc, kernel.forward(qh, k.transpose(1, 2), v.transpose(1, 2), scale, False, mask))
    return acc if acc is not None else empty_part(qh, dv)


def partial_latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, tiles: Iterable, scale: float):
    """MLA's absorbed attention (``latent_attention``) over latent tiles, not yet normalised: one key
    head shared by every query head, keys (c, k_rope), values c. q_lat [b, s, H, r], q_rope
    [b, s, H, dr]; each tile (c [b, n, r], k_rope [b, n, dr], mask [1|b, s, n] or None) ->
    (out fp32 [b, H, s, r], lse fp32 [b, H, s])."""
    q, acc = torch.cat([q_lat, q_rope], -1).transpose(1, 2), None
    for c, k_rope, mask in tiles:
        k = torch.cat([c, k_rope], -1).unsqueeze(1)  # [b, 1, n, r + dr]
        mask = None if mask is None else mask.unsqueeze(1)
        acc = merge(acc, MATH.forward(q, k, c.unsqueeze(1), scale, False, mask))
    return acc if acc is not None else empty_part(q, q_lat.size(-1))


def empty_part(qh: torch.Tensor, dv: int):
    """The (out, lse) of no keys for queries qh [b, H, t, d]: out 0 [b, H, t, dv], lse -inf."""
    lse = torch.full(qh.shape[:3], float("-inf"), dtype=torch.float32, device=qh.device)
    return qh.new_zeros(*qh.shape[:3], dv, dtype=torch.float32), lse


def tiled_attention(q: torch.Tensor, tiles: Iterable, scale: float, kernel=MATH) -> torch.Tensor:
    """Softmax attention with GQA over key tiles: q [b, t, hq, d]; each tile (k [b, n, hk, d],
    v [b, n, hk, dv], mask [1|b, t, n] bool, True = may attend) -> [b, t, hq, dv] in q's dtype."""
    return partial_attention(q, tiles, scale, kernel)[0].transpose(1, 2).to(q.dtype)


def tiled_latent_attention_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, tiles: Iterable,
                                  scale: float) -> torch.Tensor:
    """MLA's absorbed attention (``latent_attention``) over latent tiles: one key head shared by
    every query head, keys (c, k_rope), values c. q_lat [b, s, H, r], q_rope [b, s, H, dr]; each
    tile (c [b, n, r], k_rope [b, n, dr], mask [1|b, s, n]) -> [b, s, H, r] in q_lat's dtype (the
    latents')."""
    return partial_latent_attention(q_lat, q_rope, tiles, scale)[0].transpose(1, 2).to(q_lat.dtype)


def partial_sparse_latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor,
                                    idx: torch.Tensor, scale: float):
    """DSA's absorbed attention over each query's selected latents, not yet normalised: q_lat
    [b, s, H, r], q_rope [b, s, H, dr], c [b, T, r], k_rope [b, T, dr], idx [b, s, K] into T (-1 =
    none; a query may have none here) -> (out fp32 [b, H, s, r], lse fp32 [b, H, s])."""
    valid = idx >= 0
    rows = torch.arange(idx.size(0), device=idx.device)[:, None, None]
    safe = idx.clamp(min=0)
    c_sel, kr_sel = c[rows, safe].float(), k_rope[rows, safe].float()  # [b, s, K, r], [b, s, K, dr]
    scores = (torch.einsum("bshr,bskr->bhsk", q_lat.float(), c_sel)
              + torch.einsum("bshd,bskd->bhsk", q_rope.float(), kr_sel)) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where no key
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.einsum("bhsk,bskr->bhsr", p, c_sel), lse


def partial_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tok: torch.Tensor, scale: float):
    """Block-sparse GQA attention over each query's kept keys, not yet normalised: q [b, s, H, d],
    k/v [b, T, G, d], tok [b, s, G, N] into T (-1 = none; a query may have none here) ->
    (out fp32 [b, H, s, dv], lse fp32 [b, H, s]); head h reads group h // (H / G)."""
    bsz, s, heads, d = q.shape
    groups = k.size(2)
    safe = tok.clamp(min=0).permute(0, 2, 1, 3)                                     # [b, G, s, N]
    bi = torch.arange(bsz, device=q.device)[:, None, None, None]
    gi = torch.arange(groups, device=q.device)[None, :, None, None]
    k_sel, v_sel = k.transpose(1, 2)[bi, gi, safe].float(), v.transpose(1, 2)[bi, gi, safe].float()  # [b, G, s, N, d]
    qg = q.float().view(bsz, s, groups, heads // groups, d).permute(0, 2, 3, 1, 4)  # [b, G, rep, s, d]
    scores = torch.einsum("bgjrd,bgrnd->bgjrn", qg, k_sel) * scale
    scores = scores.masked_fill((tok < 0).permute(0, 2, 1, 3)[:, :, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                            # [b, G, rep, s]
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bgjrn,bgrnd->bgjrd", p, v_sel)                              # [b, G, rep, s, dv]
    return out.flatten(1, 2), lse.flatten(1, 2)
