"""Block-sparse softmax attention chosen by a block-pooled lightning indexer: letter ``B``
(MiniMax-M3's sparse layers).

GQA softmax attention as ``A`` (QK-norm, partial RoPE, output projection), whose keys are cut,
per query and per KV group, to whole blocks of ``block_size`` consecutive keys. The indexer has
its own light heads (one per KV group) and runs without gradient (its output is a selection)::

    q_i = norm(W_iq x) [b, s, Hi, Di],  k_i = norm(W_ik x) [b, T, Di]   (RoPE on the first rot channels)
    score[h, s, t] = q_i[s, h] . k_i[t]         for the causal keys t (lightning_scores, per head)
    block score    = max of its keys' scores    (a block with no visible key cannot be kept)
    kept           = the ``local_blocks`` blocks ending at the query's own (always), then the
                     best others, ``topk_blocks`` in all (ties to the earlier block)

Attention head h reads index head h // (H / Hi) = its KV group (Hi must equal the KV heads, as
in MiniMax-M3) and sees the causal keys of its kept blocks.

Blocks are cut from each sequence's first real token (``BlockTable``): a left-padded row's and
a packed document's blocks start at their first token, so a prompt selects the same keys alone,
left-padded in a batch or packed with others (for an unpadded single sequence these are HF's
blocks ``t // block_size``). A padded query (left padding) sees only itself.

Two forms of each half:
- indexer: ``select_blocks`` scores the queries in passes of ``tile_rows(T)`` rows, so a pass
  holds [b, rows, Hi, T] scores and never [s, T] (the naive form, ``naive_block_selection``,
  pools the whole [s, T] score matrix by reshaping, as transformers does);
- attention: ``block_sparse_attention`` gathers each query's kept keys (at most K = topk_blocks
  * block_size) in checkpointed query tiles: [b, G, rows, K, d] at a time, recomputed in the
  backward; the dense-mask reference (``dense_reference = True``) masks plain attention with the
  selection expanded to [b, H, s, T].

Decode cache: keys and values as ``A``, plus the indexer keys ``index_k`` [b, T, Di]; the cache
attends over the kept keys (``LayerState.attend_tokens``: a cache split over CP ranks keeps each
rank's share of the keys and values, the indexer keys whole, and merges the ranks' parts; a
quantised paged cache gathers and dequantises only the selected keys and values). The indexer
scores its cached keys a cache tile at a time (``LayerState.time_tiles``), so a quantised cache
never dequantises its whole history.
Context parallelism: the indexer keys, keys and values of the whole sequence are all-gathered
over CP (backward: reduce-scatter); each rank selects and attends for its own queries.
TP: heads and KV groups split as ``A``; the indexer's query projection is column-parallel over
its heads (one per KV group), its key projection replicated.

Parameters per layer: ``A``'s + h*Hi*Di + h*Di + 2*Di (the two norms).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megamoe.layers.cache.decode import append_kv, append_time
from megamoe.core.config import AttentionConfig
from megamoe.core.errors import ConfigError
from megamoe.layers.mixers.attention import SelfAttention
from megamoe.layers.ops.attention.context import check_documents, context_shard, tile_rows
from megamoe.layers.ops.lightning_index import lightning_scores, select_topk
from megamoe.layers.rotary import apply_rotary
from megamoe.parallel.context import position_in_document
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mixer

GATHER_ELEMENTS = 1 << 24  # gathered key elements per attention tile (64 MiB in fp32)


class BlockTable(NamedTuple):
    """The key axis [b, T] cut into blocks: ``first`` (each key's block, named by its first key),
    ``start`` (the key starts a block), ``seg`` (sequence or document id; -1 for padding)."""

    first: torch.Tensor
    start: torch.Tensor
    seg: torch.Tensor


def block_table(batch: int, total: int, block: int, pad: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, device=None) -> BlockTable:
    """Blocks of ``block`` keys from each row's first real token (``pad`` [b] left pads) or from
    each document's first token (``documents`` [b, T])."""
    t = torch.arange(total, device=device).expand(batch, -1)
    if documents is not None:
        seg, pos = documents, position_in_document(documents)
    elif pad is not None:
        pos = t - pad.to(t.device)[:, None]
        seg = torch.where(pos >= 0, 0, -1)
    else:
        seg, pos = torch.zeros_like(t), t
    first = torch.where(seg >= 0, t - pos % block, t)
    return BlockTable(first, (pos % block == 0) & (seg >= 0), seg)


def select_blocks(q: torch.Tensor, keys: torch.Tensor | None, table: BlockTable, qidx: torch.Tensor, topk: int,
                  local: int, block: int, score=None) -> torch.Tensor:
    """q [b, s, Hi, Di] at key-axis indices qidx [s], keys [b, T, Di] -> the kept blocks' first
    keys [b, s, Hi, min(topk, T)] (-1: none), in passes of ``tile_rows(T)`` queries. ``score``
    (rows of q -> their [b, r, Hi, T] scores; default ``lightning_scores`` over ``keys``) lets a
    decode cache score its keys a tile at a time."""
    total = table.first.size(1)
    score = score or (lambda q_rows: lightning_scores(q_rows, keys))
    rows = tile_rows(total, q.size(1))
    return torch.cat([_select_tile(q[:, a:a + rows], score, table, qidx[a:a + rows], topk, local, block)
                      for a in range(0, q.size(1), rows)], dim=1)


def _select_tile(q, score, table: BlockTable, qidx, topk: int, local: int, block: int) -> torch.Tensor:
    bsz, total = table.first.shape
    t = torch.arange(total, device=q.device)
    q_seg = table.seg[:, qidx]                                                     # [b, r]
    visible = (t <= qidx[:, None]) & (table.seg[:, None, :] == q_seg[..., None]) & (q_seg[..., None] >= 0)
    scores = score(q).masked_fill(~visible.unsqueeze(2), float("-inf"))           # [b, r, Hi, T]
    pooled = scores.new_full(scores.shape, float("-inf")).scatter_reduce(
        -1, table.first[:, None, None, :].expand_as(scores), scores, "amax")       # at each block's first key
    own = table.first.gather(1, qidx.expand(bsz, -1))                              # [b, r] the query's block
    for j in range(local):  # the query's own block and the ones before it (of its sequence) always stay
        prior = own - j * block
        ok = (prior >= 0) & (table.seg.gather(1, prior.clamp(min=0)) == q_seg) & (q_seg >= 0)
        idx = prior.clamp(min=0)[:, :, None, None].expand(-1, -1, pooled.size(2), 1)  # [b, r, Hi, 1]
        pooled.scatter_(-1, idx, torch.where(ok[:, :, None, None], float("inf"), pooled.gather(-1, idx)))
    valid = table.start[:, None, None, :] & (pooled > float("-inf"))
    return select_topk(pooled, valid, topk)


def selection_tokens(first: torch.Tensor, table: BlockTable, qidx: torch.Tensor, block: int) -> torch.Tensor:
    """Kept blocks' first keys [b, s, G, K] -> the causal keys they hold [b, s, G, K * block]
    (-1: none); a padded query keeps only itself."""
    total = table.first.size(1)
    tok = first[..., None] + torch.arange(block, device=first.device)               # [b, s, G, K, B]
    safe = tok.clamp(0, total - 1)
    ok = (first[..., None] >= 0) & (tok < total) & (tok <= qidx[:, None, None, None])
    ok &= table.first.gather(1, safe.flatten(1)).view_as(tok) == first[..., None]
    tok = tok.masked_fill(~ok, -1).flatten(-2)                                       # [b, s, G, K*B]
    padded = table.seg[:, qidx] < 0                                                 # [b, s]
    own = torch.full_like(tok, -1)
    own[..., 0] = qidx[None, :, None]
    return torch.where(padded[..., None, None], own, tok)


def _attend_tile(q, k, v, tok, scale: float):
    """q [b, r, H, d], k/v [b, T, G, d], tok [b, r, G, N] -> [b, r, H, d]."""
    bsz, rows, heads, d = q.shape
    groups = k.size(2)
    safe = tok.clamp(min=0).permute(0, 2, 1, 3)                                     # [b, G, r, N]
    bi = torch.arange(bsz, device=q.device)[:, None, None, None]
    gi = torch.arange(groups, device=q.device)[None, :, None, None]
    k_sel, v_sel = k.transpose(1, 2)[bi, gi, safe], v.transpose(1, 2)[bi, gi, safe]  # [b, G, r, N, d]
    qg = q.view(bsz, rows, groups, heads // groups, d).permute(0, 2, 3, 1, 4)       # [b, G, rep, r, d]
    scores = torch.einsum("bgjrd,bgrnd->bgjrn", qg, k_sel) * scale
    scores = scores.masked_fill((tok < 0).permute(0, 2, 1, 3)[:, :, None], float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.einsum("bgjrn,bgrnd->bgjrd", p, v_sel)                              # [b, G, rep, r, d]
    return out.permute(0, 3, 1, 2, 4).reshape(bsz, rows, heads, v.size(-1))


def block_sparse_attention(q, k, v, tok, scale: float) -> torch.Tensor:
    """Softmax attention of q [b, s, H, d] over each query's kept keys tok [b, s, G, N] (-1: none;
    indices into k, v [b, T, G, d]) in checkpointed tiles of about GATHER_ELEMENTS gathered key
    elements -> [b, s, H, d]."""
    rows = max(1, GATHER_ELEMENTS // max(1, q.size(0) * tok.size(2) * tok.size(3) * q.size(-1)))
    if rows >= q.size(1):
        return _attend_tile(q, k, v, tok, scale)
    outs = [checkpoint(_attend_tile, q[:, a:a + rows], k, v, tok[:, a:a + rows], scale, use_reentrant=False)
            for a in range(0, q.size(1), rows)]
    return torch.cat(outs, dim=1)


def tokens_to_mask(tok: torch.Tensor, total: int, heads: int) -> torch.Tensor:
    """tok [b, s, G, N] (-1: none) -> bool [b, H, s, total] (head h reads group h // (H/G))."""
    b, s, groups, _ = tok.shape
    mask = torch.zeros(b, s, groups, total + 1, dtype=torch.bool, device=tok.device)
    mask.scatter_(-1, torch.where(tok < 0, total, tok), True)
    return mask[..., :total].repeat_interleave(heads // groups, dim=2).transpose(1, 2)


def naive_block_selection(q: torch.Tensor, keys: torch.Tensor, topk: int, local: int, block: int) -> torch.Tensor:
    """The reference for one unpadded sequence whose queries are its last s keys, as
    transformers computes it: all [s, T] scores, pooled by reshaping into blocks t // block ->
    kept blocks' first keys [b, s, Hi, min(topk, blocks)] (-1: none)."""
    b, s, heads, _ = q.shape
    total = keys.size(1)
    qpos = torch.arange(total - s, total, device=q.device)
    scores = lightning_scores(q, keys).masked_fill((torch.arange(total) > qpos[:, None])[None, :, None], float("-inf"))
    nblocks = -(-total // block)
    scores = torch.nn.functional.pad(scores, (0, nblocks * block - total), value=float("-inf"))
    pooled = scores.view(b, s, heads, nblocks, block).amax(-1)                     # [b, s, Hi, blocks]
    for j in range(local):
        pooled[:, torch.arange(s), :, (qpos // block - j).clamp(min=0)] = float("inf")
    chosen = select_topk(pooled, pooled > float("-inf"), topk)
    return torch.where(chosen >= 0, chosen * block, -1)


class BlockIndexer(nn.Module):
    """x [b, s, h] -> the kept blocks' first keys [b, s, Hi/tp, K] for this rank's KV groups."""

    def __init__(self, cfg: AttentionConfig, ctx: BuildContext):
        super().__init__()
        idx = cfg.block_index
        self.heads, self.dim = idx.num_heads // ctx.groups.tp_size, idx.head_dim
        self.block, self.topk, self.local = idx.block_size, idx.topk_blocks, idx.local_blocks
        b = ctx.backend
        self.linear_q = b.column_linear(ctx, ctx.hidden_size, idx.num_heads * idx.head_dim)
        self.linear_k = b.replicated_linear(ctx, ctx.hidden_size, idx.head_dim)
        self.q_norm = b.norm(ctx, idx.head_dim, head_sharded=True)
        self.k_norm = b.norm(ctx, idx.head_dim)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, cos_sin, table: BlockTable, qidx: torch.Tensor, state: dict | None, cp,
                cache=None):
        """cos_sin: the attention's RoPE tables [b, s, rot]; table: the ``BlockTable`` of the T keys
        the queries see; qidx: the queries' key-axis indices [s]; state: the decode cache (indexer
        keys appended); cp: the ``ContextShard`` (keys all-gathered); cache: the whole decode cache
        (given when decoding without CP: the keys are then scored a cache tile at a time)."""
        q = self.linear_q(x)
        bsz, s = q.shape[:2]
        q = self.q_norm(q.view(bsz, s, self.heads, self.dim))
        k = self.k_norm(self.linear_k(x))                                             # [b, s, Di]
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k.unsqueeze(2), cos, sin).squeeze(2)
        if cache is not None:  # decoding: [b, r, Hi, tile] scores at a time, never the whole keys
            state.extend({"index_k": k})
            tiles, total = functools.partial(state.time_tiles, cache, ("index_k",), s), cache.seen + s
            score = lambda q_rows: torch.cat([lightning_scores(q_rows, kt) for kt, _ in tiles()],  # noqa: E731
                                             dim=-1)[..., :total]  # (a reserved cache's tiles run past total)
            return select_blocks(q, None, table, qidx, self.topk, self.local, self.block, score)
        if cp is not None:
            k = cp.gather(k)
        if state is not None:
            k = append_time(state, "index_k", k)
        return select_blocks(q, k, table, qidx, self.topk, self.local, self.block)


class BlockSparseAttention(SelfAttention):
    """x: [b, s, h] (``[b, s/tp, h]`` under SP) -> same (module docstring)."""

    def __init__(self, cfg: AttentionConfig, ctx: BuildContext, layer_number: int = 0):
        super().__init__(cfg, ctx, layer_number)
        if cfg.block_index is None:
            raise ConfigError("model.attention.block_index is not set but model.layout uses 'B' (block-sparse "
                              "attention needs the indexer settings)")
        self.indexer = BlockIndexer(cfg, ctx)
        self.scale = cfg.softmax_scale or self.head_dim ** -0.5
        self.block_core = ctx.backend.block_sparse_attention(ctx)
        self.dense_reference = False  # True: plain attention masked with the selection expanded

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        cp = context_shard(info)  # with a cache: a prefill under CP
        q, k, v, gate = self.project(x, info)
        decoding = cp is None and info.cache is not None and not self.dense_reference  # the cache attends
        k_all, v_all = (None, None) if decoding else self.keys(k, v, info, cp)
        bsz, total = q.size(0), info.cache.seen + q.size(1) if decoding else k_all.size(1)
        check_documents(info.documents, bsz, total)
        pad = None if info.cache is None else info.cache.pad
        table = block_table(bsz, total, self.indexer.block, pad, info.documents, x.device)
        qidx = cp.local_index(x.device) if cp is not None else torch.arange(total - q.size(1), total, device=x.device)
        state = None if info.cache is None else info.cache.layer(self.layer_number)
        first = self.indexer(x, self.cos_sin(info), table, qidx, state, cp,  # (its keys: the same T)
                             info.cache if decoding else None)
        tok = selection_tokens(first, table, qidx, self.indexer.block)
        if self.dense_reference:
            mask = tokens_to_mask(tok, total, q.size(2))
            out = self.core(q, k_all, v_all, mask=mask)
        elif decoding:  # over the kept keys the cache holds (a cache split over CP: each rank's share, merged)
            out = state.attend_tokens(info.cache, q, k, v, tok, self.block_core, self.scale)
        else:
            out = self.block_core(q, k_all, v_all, tok, self.scale)
        out = out.reshape(*out.shape[:2], -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.linear_proj(out)

    def keys(self, k, v, info: ForwardInfo, cp):
        """Keys and values of every position the queries may see: all-gathered over CP (a
        prefill under CP caches them), appended to the decode cache, or the given ones."""
        if cp is not None:
            k_all, v_all = cp.gather(k), cp.gather(v)
            if info.cache is not None:  # a prefill: every rank's keys, or this rank's (a split cache)
                info.cache.layer(self.layer_number).append_prefill(cp, {"k": k, "v": v}, {"k": k_all, "v": v_all})
            return k_all, v_all
        if info.cache is not None:
            return append_kv(info.cache.layer(self.layer_number), k, v)
        return k, v


register_mixer("B", ModuleSpec(BlockSparseAttention))
