"""The parts of DeepSeek-V4's attention with weights: the compressor, the lightning indexer over
compressed entries, and the grouped output projection (``megamoe.layers.mixers.compressed_attention``).

Compressor (``rate`` tokens per entry, ``overlap`` for CSA): one replicated GEMM gives each
token's rows ``[kv | gate]`` (W = D, or 2D with overlap); complete blocks are pooled
(``ops.compressed_attention.pool``), RMS-normed (weighted) and turned by RoPE at the block's
first position (interleaved pairs on the last ``rope_dim`` channels)::

    e_w = rope(norm(pool_w(kv, gate + position_bias)), pos_w)                      [b, N, D]

Indexer (CSA): its own compressor at ``Di`` channels gives keys k_n; per query, light heads from
the query latent score every entry the query may see and the best ``topk`` are kept::

    q_i = rope(W_iq q_latent)  [b, s, Hi, Di]      w = W_w x * Hi^-1/2  [b, s, Hi]
    score[s, n] = sum_h w_h relu(q_i[s, h] . k_n) * Di^-1/2

It runs without gradient (its output is indices, as in HF). Ties go to the earlier entry
(``dsa.select_topk``), so a query's choice does not depend on how many later entries a pass
holds.

Grouped output projection: the heads' outputs are cut into ``o_groups`` groups of
``heads / o_groups`` heads; group g is projected by its own [o_lora_rank, heads*D/groups]
matrix. Under TP a rank holds whole groups (its heads'), so the projection is local.

Parameters: compressor h*2W + rate*W + D; indexer (its compressor at Di with overlap) + r_q*Hi*Di
+ h*Hi; grouped projection H*D*o_lora_rank.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.core.config import DSAConfig
from megamoe.layers.ops.attention.context import tile_rows
from megamoe.layers.mixers.dsa import select_topk
from megamoe.layers.ops.compressed_attention import Blocks, Entries, pool_blocks
from megamoe.layers.ops.compressed_attention.naive import entry_mask
from megamoe.layers.rotary import apply_rotary_pairs
from megamoe.parallel.sharding import Shard, const_init, mark_init, normal_init, set_sharding
from megamoe.layers.spec import BuildContext


class Compressor(nn.Module):
    """Tokens -> pooled, normed, rotated entries of ``dim`` channels, one per complete block."""

    def __init__(self, ctx: BuildContext, dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.width = dim * (2 if overlap else 1)
        b = ctx.backend
        self.linear_kv_gate = b.replicated_linear(ctx, ctx.hidden_size, 2 * self.width)  # rows [kv | gate]
        self.position_bias = nn.Parameter(torch.empty(rate, self.width, dtype=ctx.dtype, device=ctx.device))
        mark_init(self.position_bias, const_init(0.0))
        self.norm = b.norm(ctx, dim, eps=eps, zero_centered=False)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s(/tp), h] -> [b, s, 2W] rows [kv | gate] of every token."""
        return self.linear_kv_gate(x)

    def pool(self, rows: torch.Tensor, blocks: Blocks, cos_sin) -> torch.Tensor:
        """rows [b, T, 2W] of a segment, its blocks, RoPE tables [b, N, rot] at the blocks' first
        positions -> entries [b, N, D]."""
        kv, gate = rows.split([self.width, self.width], dim=-1)
        pooled = pool_blocks(kv, gate, self.position_bias, blocks, self.rate, self.overlap)
        cos, sin = cos_sin
        return apply_rotary_pairs(self.norm(pooled).unsqueeze(2), cos, sin).squeeze(2)


class CompressedIndexer(nn.Module):
    """CSA's lightning indexer: its compressor's keys and the light query heads."""

    def __init__(self, cfg: DSAConfig, ctx: BuildContext, q_lora_rank: int, rate: int, eps: float):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.num_heads, cfg.head_dim, cfg.topk
        b = ctx.backend
        self.compressor = Compressor(ctx, cfg.head_dim, rate, overlap=True, eps=eps)
        self.linear_q = b.replicated_linear(ctx, q_lora_rank, cfg.num_heads * cfg.head_dim, sequence_parallel=False)
        self.linear_weights = b.replicated_linear(ctx, ctx.hidden_size, cfg.num_heads)

    @torch.no_grad()
    def select(self, x: torch.Tensor, q_latent: torch.Tensor, cos_sin, keys: Entries, q_pos: torch.Tensor,
               q_doc: torch.Tensor | None, key_tiles=None) -> torch.Tensor:
        """x [b, s(/tp), h], q_latent [b, s, r_q], query RoPE tables [b, s, rot], the entries' keys
        [b, N, Di] (queries at positions q_pos [s] of the entries' axis, documents q_doc [b, s]) ->
        indices [b, s, K] into the entries (-1: none), K = min(topk, N). Queries in passes of
        ``tile_rows(N)`` rows. ``key_tiles``: () -> the keys' values as [b, n, Di] tiles in order (a
        decode cache's, read a tile at a time; ``keys.values`` may then be None)."""
        bsz, s = q_latent.shape[:2]
        cos, sin = cos_sin
        q = apply_rotary_pairs(self.linear_q(q_latent).view(bsz, s, self.heads, self.dim), cos, sin)
        weights = self.linear_weights(x).float() * self.heads ** -0.5  # [b, s, Hi]
        key_tiles = key_tiles or (lambda: (keys.values,))
        n = keys.end.size(1)
        rows = tile_rows(max(n, 1))
        parts = []
        for a in range(0, s, rows):
            e = min(s, a + rows)
            scores = torch.cat([self.score(q[:, a:e], kt, weights[:, a:e]) for kt in key_tiles()], dim=-1)
            seen = entry_mask(q_pos[a:e], keys, None if q_doc is None else q_doc[:, a:e])
            parts.append(select_topk(scores, seen, self.topk))
        return torch.cat(parts, dim=1)


    def score(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """q [b, s, Hi, Di], keys [b, n, Di], weights [b, s, Hi] -> [b, s, n] fp32 scores."""
        per_head = torch.relu(torch.einsum("bshd,bnd->bshn", q.float(), keys.float()))
        return torch.einsum("bsh,bshn->bsn", weights, per_head) * self.dim ** -0.5


class GroupedProjection(nn.Module):
    """x [b, s, heads*D] (this rank's heads) -> [b, s, groups * out] (this rank's groups): group g's
    heads through its own matrix. weight [groups*out, heads*D/groups], rows split over TP."""

    def __init__(self, ctx: BuildContext, groups: int, in_per_group: int, out_per_group: int):
        super().__init__()
        tp = ctx.groups.tp_size
        self.groups, self.out = groups // tp, out_per_group
        w = torch.empty(groups * out_per_group // tp, in_per_group, dtype=ctx.dtype, device=ctx.device)
        self.weight = nn.Parameter(w)
        set_sharding(self.weight, Shard(0, "tp"))
        mark_init(self.weight, normal_init(ctx.init_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xg = x.reshape(-1, self.groups, x.size(-1) // self.groups).transpose(0, 1)  # [g, n, in]
        w = self.weight.view(self.groups, self.out, -1)  # [g, out, in]
        return torch.bmm(xg, w.transpose(1, 2)).transpose(0, 1).reshape(*lead, self.groups * self.out)
