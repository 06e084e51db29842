"""DeepSeek sparse attention on MLA: letters ``D`` (DeepSeek-V3.2, GLM-5), ``R`` (GLM-5's shared
indexer) and ``I`` (GLM-5-Next indexed).

A lightning indexer picks, per query, the keys the attention may see; the attention is MLA
restricted to them. Indexer (its own light heads, computed without gradient as in HF: it
is trained by its own objective, not through the selection)::

    q_i = W_iq q_latent  [b, s, Hi, Di]      k_i = LayerNorm(W_ik x)  [b, T, Di]
    score[s, t] = sum_h (W_w x_s)_h / sqrt(Hi) * relu(q_i[s, h] . k_i[t] / sqrt(Di))

``D``: the first qk_rope_head_dim indexer channels get RoPE (``indexer.rope``: rotate-half for
DeepSeek-V3.2, interleaved pairs for GLM-5); each query keeps its ``topk`` best causal keys.
``R`` (GLM-5 ``indexer_types: shared``): no indexer; the layer attends over the selection of
the nearest ``D`` layer before it in the same forward (``info.memo``, keyed by that layer's
number, so a recomputed layer finds the same selection in backward). ``I`` (GLM-5, no RoPE): keys are scored in pools of ``kpool``
consecutive tokens (pool key = channel-wise softmax(W_pg x + ape)-weighted mean of its keys);
only complete pools whose last token is visible compete, ``topk / kpool`` of them are kept
and expanded to their tokens, and the incomplete visible tail pool is always added.

Ties are broken towards the earlier key (a stable sort), so the selection of a query does not
depend on how many future keys a pass holds (decoding equals the full forward).

Two attentions over the selection (shapes: indices [b, s, K], -1 = no key):
- ``sparse_latent_attention``: gathers the K latents of each query and attends in the
  absorbed form (the fast path, and the decode path);
- the dense-mask reference: expanded keys/values and a [b, s, T] mask built from the indices
  (``SparseMLA(..).dense_reference = True``), as HF computes it.

Decode cache: MLA's latents, plus the indexer keys (``index_k`` [b, T, Di]; for ``I`` also
``index_gate`` [b, T, Di], from which the pools are rebuilt). The cache attends over the
selected latents (``LayerState.attend_selected``): a cache split over CP ranks keeps each rank's
share of the latents (the indexer keys whole) and merges the ranks' parts; a quantised paged
cache gathers and dequantises only the selected latents. ``D`` scores its cached indexer keys a
cache tile at a time (``LayerState.time_tiles``), ``I`` its pools (``position_tiles``), so a
quantised cache never dequantises its whole history.

Context parallelism: the indexer keys (and I's pool gates) and MLA's latents are all-gathered
over CP, so each rank selects among every key of the sequence for its own queries (indices
into the whole sequence). Packed documents: ``D`` selects only keys of the query's document,
``I`` cuts pools from each document's start (``Indexer.pool_table``). The indexer selects in
passes of ``context_attention.tile_rows(T)`` queries, so its [b, rows, Hi, T] scores stay
bounded at long contexts.

Parameters per layer: MLA's + r_q*Hi*Di + h*Di + 2*Di (LayerNorm) + h*Hi
  [+ kpool*Di + Di*h for I; R: MLA's only].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.layers.cache.decode import append_time, row_aligned
from megamoe.core.config import DSAConfig, MLAConfig
from megamoe.core.errors import ConfigError
from megamoe.layers.ops.attention.context import (check_documents, context_shard, document_mask, tile_rows,
                                               tiled_sparse_latent_attention)
from megamoe.layers.ops.indexer_loss import IndexerObjective, attention_target, head_summed_probs, indexer_kl
from megamoe.layers.ops.lightning_index import lightning_scores, select_topk
from megamoe.layers.mixers.mla import MultiLatentAttention
from megamoe.layers.rotary import apply_rotary, apply_rotary_interleaved, cached_yarn_cos_sin
from megamoe.parallel import comm
from megamoe.parallel.context import position_in_document
from megamoe.parallel.sharding import const_init, mark_init
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mixer


def query_positions(s: int, total: int, device=None) -> torch.Tensor:
    """Positions of the s queries, the last s of ``total`` keys."""
    return torch.arange(total - s, total, device=device)


def indices_to_mask(idx: torch.Tensor, total: int) -> torch.Tensor:
    """indices [b, s, K] (-1 = none) -> bool mask [b, s, total], True at the selected keys."""
    mask = torch.zeros(*idx.shape[:2], total + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, torch.where(idx < 0, total, idx), True)  # -1 lands in a spare column
    return mask[..., :total]


def sparse_latent_attention(q_lat, q_rope, c, k_rope, idx, scale: float):
    """Absorbed MLA attention over each query's selected keys only.

    q_lat [b, s, H, r], q_rope [b, s, H, dr], c [b, T, r], k_rope [b, T, dr], idx [b, s, K]
    (-1 = none; every query has at least one) -> [b, s, H, r].
    """
    valid = idx >= 0
    rows = torch.arange(idx.size(0), device=idx.device)[:, None, None]
    safe = idx.clamp(min=0)
    c_sel, kr_sel = c[rows, safe], k_rope[rows, safe]  # [b, s, K, r], [b, s, K, dr]
    scores = (torch.einsum("bshr,bskr->bshk", q_lat, c_sel) + torch.einsum("bshd,bskd->bshk", q_rope, kr_sel)) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(c.dtype)
    return torch.einsum("bshk,bskr->bshr", p, c_sel)


SELECTION = "dsa_selection"  # info.memo key (with the layer number) of a D layer's selection


class PoolTable(NamedTuple):
    """GLM-5's candidate pools: keys [b, N, Di] (None: scored elsewhere), first token [N], and for packed documents
    ok [b, N] (starts a complete pool of its document), documents [b, T], in_doc [b, T]."""

    keys: torch.Tensor
    first: torch.Tensor
    ok: torch.Tensor | None
    documents: torch.Tensor | None
    in_doc: torch.Tensor | None


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, statistics in fp32 (the indexer's key norm, eps 1e-6)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        mark_init(self.weight, const_init(1.0))
        mark_init(self.bias, const_init(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class Indexer(nn.Module):
    """The lightning indexer: x [b, s, h], q_latent [b, s, r_q] -> key indices [b, s, K].

    Replicated over TP (every rank selects the same keys); ``pooled`` selects GLM-5's k-pool
    form. ``rope_dim`` channels are rotated as ``cfg.rope`` says (``D``; 0 for ``I``).
    """

    def __init__(self, cfg: DSAConfig, ctx: BuildContext, q_lora_rank: int, rope_dim: int, pooled: bool):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.num_heads, cfg.head_dim, cfg.topk
        self.rope_dim, self.rope, self.pooled, self.kpool = rope_dim, cfg.rope, pooled, cfg.kpool if pooled else 1
        b = ctx.backend
        self.linear_q = b.replicated_linear(ctx, q_lora_rank, self.heads * self.dim, sequence_parallel=False)
        self.linear_k = b.replicated_linear(ctx, ctx.hidden_size, self.dim)
        self.k_norm = LayerNorm(self.dim, dtype=ctx.dtype, device=ctx.device)
        self.linear_weights = b.replicated_linear(ctx, ctx.hidden_size, self.heads)
        if pooled:
            self.linear_pool_gate = b.replicated_linear(ctx, ctx.hidden_size, self.dim)
            mark_init(self.linear_pool_gate.weight, const_init(1.0))  # as HF initialises it
            self.pool_ape = nn.Parameter(torch.empty(self.kpool, self.dim, dtype=ctx.dtype, device=ctx.device))
            mark_init(self.pool_ape, const_init(0.0))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos_sin, state: dict | None, cache=None,
                cp=None, documents: torch.Tensor | None = None):
        """x [b, s(/tp), h], q_latent [b, s, r_q], cos_sin: RoPE tables [b, s, rope_dim] (or None),
        state: this layer's decode cache (or None), cache: the whole decode cache (its padding),
        cp: the ``ContextShard`` (keys all-gathered over CP, so the top-k sees every key of the
        sequence), documents: [b, S] packed document ids (no key of another document is selected)."""
        bsz, s = q_latent.shape[:2]
        q, k, gate, weights = self.project(x, q_latent, cos_sin, cp)
        if state is not None and cp is None:
            if self.pooled:
                return self.select_pools_cached(q, k, gate, weights, state, cache)
            return self.select_cached(q, k, weights, state, cache)
        if state is not None:  # (under CP: a prefill, the cache gets the gathered keys)
            k = append_time(state, "index_k", k)
            gate = append_time(state, "index_gate", gate) if self.pooled else None
        check_documents(documents, bsz, k.size(1))
        qpos = query_positions(s, k.size(1), k.device) if cp is None else cp.local_index(k.device)
        pad = None if cache is None else cache.pad
        valid = None if pad is None or self.pooled else cache.attention_mask(s, k.size(1), device=k.device)
        table = self.pool_table(k, gate, documents) if self.pooled and pad is None else None
        # queries in passes of `rows`: at most [b, rows, Hi, T] scores exist at a time (long contexts)
        rows = tile_rows(k.size(1))
        parts = [self.select(q[:, a:a + rows], k, gate, weights[:, a:a + rows], qpos[a:a + rows], pad,
                             None if valid is None else valid[..., a:a + rows, :], documents, table)
                 for a in range(0, s, rows)]
        return torch.cat(parts, dim=1)

    def select_cached(self, q, k, weights, state, cache) -> torch.Tensor:
        """``D`` with a decode cache: keys k [b, s, Di] appended, then the kept keys scored one cache
        tile at a time (``time_tiles``: a quantised cache never dequantises its whole history), so
        a query pass holds [b, rows, Hi, tile] per-head scores and its [b, rows, T] sums ->
        indices [b, s, K]."""
        s = q.size(1)
        state.extend({"index_k": k})
        rows = tile_rows(cache.seen + s, s)
        parts = []
        for a in range(0, s, rows):
            scored = [(self.score(q[:, a:a + rows], kt, weights[:, a:a + rows]), m[..., a:a + rows, :])
                      for kt, m in state.time_tiles(cache, ("index_k",), s)]
            scores = torch.cat([sc for sc, _ in scored], dim=-1)
            valid = torch.cat([m for _, m in scored], dim=-1).expand_as(scores)
            parts.append(select_topk(scores, valid, self.topk))
        return torch.cat(parts, dim=1)

    def select_pools_cached(self, q, k, gate, weights, state, cache) -> torch.Tensor:
        """``I`` with a decode cache: keys and pool gates [b, s, Di] appended, then the pools scored
        one cache tile of whole pools at a time, cut from each row's first real token
        (``position_tiles``), so a query pass holds one tile's pools and its [b, rows, N] scores ->
        indices [b, s, K] into the common time axis (a padded query selects only itself)."""
        s, kp = q.size(1), self.kpool
        state.extend({"index_k": k, "index_gate": gate})
        total = cache.seen + s
        qpos = query_positions(s, total, q.device)
        pad = cache.pad_or_zeros().to(q.device)
        qpos_row = qpos[None, :] - pad[:, None]  # [b, s] positions of the queries in their row
        table = PoolTable(None, torch.arange(total // kp, device=q.device) * kp, None, None, None)
        rows = tile_rows(total, s)
        parts = []
        for a in range(0, s, rows):
            q_a, w_a = q[:, a:a + rows], weights[:, a:a + rows]
            scores = torch.cat([self.score(q_a, self.pool_table(kt, gt).keys, w_a)
                                for kt, gt in state.position_tiles(cache, ("index_k", "index_gate"), s, kp)],
                               dim=-1)[..., :total // kp]  # (a reserved cache's tiles run past total: cut off)
            parts.append(self.choose_pools(table, q_a, w_a, qpos_row[:, a:a + rows], scores))
        return self.shift_back(torch.cat(parts, dim=1), qpos, qpos_row, pad)

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, cos_sin, cp=None):
        """Queries [b, s, Hi, Di], keys [b, T, Di] (and GLM-5's pool gates [b, T, Di], else None; all
        T keys of the sequence under CP) and head weights [b, s, Hi] (fp32, / sqrt(Hi))."""
        bsz, s = q_latent.shape[:2]
        q = self.linear_q(q_latent).view(bsz, s, self.heads, self.dim)
        k = self.k_norm(self.linear_k(x))  # [b, s, Di]
        if self.rope_dim:
            q, k = self.rotate(q, cos_sin), self.rotate(k.unsqueeze(2), cos_sin).squeeze(2)
        gate = self.linear_pool_gate(x) if self.pooled else None
        if cp is not None:  # the whole sequence's keys (and pool gates), global order
            k, gate = cp.gather(k), (cp.gather(gate) if self.pooled else None)
        return q, k, gate, self.linear_weights(x).float() * self.heads ** -0.5

    def training_scores(self, x: torch.Tensor, q_latent: torch.Tensor, cos_sin, cp=None, documents=None):
        """The scores of every candidate, with gradient (for ``megamoe.layers.ops.indexer_loss``; the
        caller detaches the inputs): scores [b, s, N], valid [b, s, N] (the candidates each query
        may select) and, for GLM-5's pools, their first tokens [N] (None: the candidates are the
        T keys)."""
        q, k, gate, weights = self.project(x, q_latent, cos_sin, cp)
        check_documents(documents, q.size(0), k.size(1))
        qpos = query_positions(q.size(1), k.size(1), k.device) if cp is None else cp.local_index(k.device)
        if self.pooled:
            table = self.pool_table(k, gate, documents)
            return self.score(q, table.keys, weights), self.pool_valid(table, qpos, q.size(0)), table.first
        scores = self.score(q, k, weights)
        return scores, document_mask(documents, qpos, torch.arange(k.size(1), device=k.device)).expand_as(scores), None

    def rotate(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """x [b, s, heads, Di] with its first ``rope_dim`` channels rotated (``indexer.rope``).
        Interleaved pairs come out de-interleaved, the same permutation for queries and keys."""
        cos, sin = cos_sin
        if self.rope == "half":
            return apply_rotary(x, cos, sin)
        rot = apply_rotary_interleaved(x[..., :self.rope_dim], cos, sin)
        return torch.cat([rot, x[..., self.rope_dim:]], dim=-1)

    def select(self, q, k, gate, weights, qpos, pad, valid, documents, table):
        """The selection of some queries (``forward``'s tensors cut to their rows): indices [b, rows, K]."""
        if self.pooled:
            if pad is None:
                return self.choose_pools(table, q, weights, qpos)
            return self.select_pools_padded(q, k, gate, weights, qpos, pad.to(k.device))
        scores = self.score(q, k, weights)
        if valid is None:  # (a padded batch's valid keys come from the cache)
            valid = document_mask(documents, qpos, torch.arange(k.size(1), device=k.device)).expand_as(scores)
        return select_topk(scores, valid, self.topk)

    def score(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """q [b, s, Hi, Di], keys [b, N, Di], weights [b, s, Hi] -> [b, s, N] (fp32)."""
        return lightning_scores(q, keys, weights, scale=self.dim ** -0.5, relu=True)

    def select_pools_padded(self, q, k, gate, weights, qpos, pad):
        """GLM-5 selection for left-padded rows (pad [b]): pools are cut from each row's first real
        token, so the keys are shifted to start there, selected, and the indices shifted back.
        A padded query selects only itself."""
        qpos_row = qpos[None, :] - pad[:, None]  # [b, s] positions of the queries in their row
        idx = self.choose_pools(self.pool_table(row_aligned(k, pad), row_aligned(gate, pad)), q, weights, qpos_row)
        return self.shift_back(idx, qpos, qpos_row, pad)

    @staticmethod
    def shift_back(idx, qpos, qpos_row, pad) -> torch.Tensor:
        """Indices [b, s, K] chosen among row positions -> into the common time axis (+ pad [b]);
        a padded query (qpos_row < 0) keeps only itself (qpos [s])."""
        idx = torch.where(idx >= 0, idx + pad[:, None, None], -1)
        own = torch.full_like(idx, -1)
        own[..., 0] = qpos
        return torch.where((qpos_row < 0).unsqueeze(-1), own, idx)

    def pool_table(self, k, gate, documents: torch.Tensor | None = None) -> PoolTable:
        """GLM-5's candidate pools of ``kpool`` consecutive keys, built once per forward. Without
        documents: the T // kpool complete pools from token 0. With packed documents [b, T]: pools
        are cut from each document's start; a pool is named by its first token, so the candidates
        are all T tokens (those that start a complete pool are valid), ranked in token order as
        the plain pools are."""
        bsz, total, kp = k.size(0), k.size(1), self.kpool
        offsets = torch.arange(kp, device=k.device)
        if documents is None:
            first = torch.arange(total // kp, device=k.device) * kp  # only complete pools can be selected
            ok = in_doc = None
        else:
            first = torch.arange(total, device=k.device)
            in_doc = position_in_document(documents)  # [b, T]
            last = (first + kp - 1).clamp(max=total - 1)
            ok = (in_doc % kp == 0) & (in_doc.gather(1, last.expand(bsz, -1)) == in_doc + kp - 1)
        members = (first[:, None] + offsets).clamp(max=total - 1)  # [N, kp]
        keys, logits = k[:, members], gate[:, members].float() + self.pool_ape.float()  # [b, N, kp, Di]
        pool_keys = (torch.softmax(logits, dim=2).to(keys.dtype) * keys).sum(dim=2)  # [b, N, Di]
        return PoolTable(pool_keys, first, ok, documents, in_doc)

    def pool_valid(self, table: PoolTable, qpos: torch.Tensor, bsz: int) -> torch.Tensor:
        """[b, s, N]: the pools a query may select (complete, last token visible, its document).
        qpos: [s] query positions, or [b, s] per row."""
        valid = (table.first + self.kpool - 1 <= qpos[..., None]).expand(bsz, -1, -1)
        if table.documents is not None:
            q_doc = table.documents[:, qpos]  # [b, s]
            valid = valid & table.ok[:, None, :] & (table.documents[:, None, table.first] == q_doc[..., None])
        return valid

    def choose_pools(self, table: PoolTable, q, weights, qpos, scores=None) -> torch.Tensor:
        """Score the pools a query sees (complete, last token visible, its document), keep topk/kpool
        of them, add the query's incomplete tail pool. qpos: [s] query positions, or [b, s] per row;
        scores: the pools' [b, s, N] scores when the caller has them (``table.keys`` unused)."""
        bsz, kp = q.size(0), self.kpool
        offsets = torch.arange(kp, device=q.device)
        valid = self.pool_valid(table, qpos, bsz)  # [b, s, N]
        in_query = qpos if table.documents is None else table.in_doc[:, qpos]
        scores = self.score(q, table.keys, weights) if scores is None else scores
        chosen = select_topk(scores, valid, self.topk // kp)  # [b, s, k]
        start = table.first[chosen.clamp(min=0)].unsqueeze(-1)
        tokens = (start + offsets).masked_fill(chosen.unsqueeze(-1) < 0, -1).flatten(-2)
        if kp == 1:
            return tokens
        tail_count = (in_query + 1) % kp  # tokens of the query's incomplete pool
        tail = (qpos + 1 - tail_count)[..., None] + offsets[:-1]  # [(b,) s, kp - 1]
        tail = tail.masked_fill(offsets[:-1] >= tail_count[..., None], -1)
        return torch.cat([tokens, tail.expand(bsz, -1, -1)], dim=-1)


class SparseMLA(MultiLatentAttention):
    """MLA whose queries see only the keys the indexer selects. x: [b, s, h] -> same."""

    def __init__(self, cfg: MLAConfig, ctx: BuildContext, layer_number: int = 0, *, pooled: bool = False):
        super().__init__(cfg, ctx, layer_number)
        if cfg.indexer is None:
            raise ConfigError(f"model.mla.indexer is not set but model.layout uses '{'I' if pooled else 'D'}' "
                              "(sparse attention needs the indexer settings)")
        rope_dim = 0 if pooled else cfg.qk_rope_head_dim
        self.indexer = Indexer(cfg.indexer, ctx, cfg.q_lora_rank, rope_dim, pooled)
        self.dense_reference = False  # True: expanded heads and a mask built from the indices
        self.sparse_core = ctx.backend.sparse_latent_attention(ctx)
        self.objective = IndexerObjective(layer_number)  # indexer training (train.indexer), off by default

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        cp = context_shard(info)  # with a cache: a prefill under CP
        q_nope, q_rope, q_latent, c, k_rope = self.project(x, info)
        # the indexer rotates with MLA's (YaRN) tables
        cos_sin = cached_yarn_cos_sin(info, self.dr, self.theta, self.yarn) if self.indexer.rope_dim else None
        state = None if info.cache is None else info.cache.layer(self.layer_number)
        # under CP the indexer keys and the latents are all-gathered: idx indexes the whole
        # sequence, and each rank attends its own queries over it
        training = self.objective.active(self)
        # the indexer's dense warm-up: attention over every key (idx None), the indexer trained beside it
        warmup = training and self.objective.mode == "warmup"
        idx = None if warmup else self.indexer(x, q_latent, cos_sin, state, info.cache, cp, info.documents)
        info.memo[(SELECTION, self.layer_number)] = idx  # for the R layers after this one
        out = self.attend(x, info, q_nope, q_rope, c, k_rope, idx)
        if not training:
            return out
        kl = indexer_kl(*self.indexer_target(x, q_latent, cos_sin, info, q_nope, q_rope, c, k_rope, idx))
        return self.objective.attach(out, kl)

    def indexer_target(self, x, q_latent, cos_sin, info: ForwardInfo, q_nope, q_rope, c, k_rope, idx):
        """What the indexer is trained on (``megamoe.layers.ops.indexer_loss``): its scores with gradient
        (inputs detached: the loss trains the indexer only), the attention's distribution over the
        candidates (no gradient), and the candidates: every key the query may see (idx None, the
        warm-up), or those it selected (sparse). GLM-5's pools sum their tokens' attention."""
        cp = context_shard(info)
        scores, valid, first = self.indexer.training_scores(x.detach(), q_latent.detach(), cos_sin, cp, info.documents)
        with torch.no_grad():
            c_all, kr_all = (c, k_rope) if cp is None else (cp.gather(c), cp.gather(k_rope))
            q_lat, total = self.absorbed_query(q_nope), c_all.size(1)
            qpos = query_positions(q_lat.size(1), total, x.device) if cp is None else cp.local_index(x.device)
            allowed = document_mask(info.documents, qpos, torch.arange(total, device=x.device))
            if idx is not None:  # the sparse attention's keys
                allowed = allowed & indices_to_mask(idx, total)
            rows = tile_rows(total)  # query tiles bound the [b, rows, H, T] scores
            head_sum = torch.cat([head_summed_probs(
                (torch.einsum("bshr,btr->bsht", q_lat[:, a:a + rows], c_all)
                 + torch.einsum("bshd,btd->bsht", q_rope[:, a:a + rows], kr_all)) * self.scale,
                allowed[:, a:a + rows]) for a in range(0, q_lat.size(1), rows)], dim=1)
            target = attention_target(head_sum, self.tp_group)  # [b, s, T]
            if first is not None:  # per pool: the mass of its tokens
                members = (first[:, None] + torch.arange(self.indexer.kpool, device=x.device)).clamp(max=total - 1)
                target = target[..., members].sum(-1)
            if idx is not None:
                chosen = indices_to_mask(idx, total)
                valid = valid & (chosen if first is None else chosen[..., first])
        return scores, target, valid

    def attend(self, x, info: ForwardInfo, q_nope, q_rope, c, k_rope, idx: torch.Tensor | None) -> torch.Tensor:
        """MLA over the selected keys idx [b, s, K] (indices into the cached/gathered latents);
        None: over every key (the indexer's dense warm-up)."""
        cp = context_shard(info)
        if idx is None:
            return self.attend_dense(x, info, q_nope, q_rope, c, k_rope)
        if self.dense_reference:
            c_all, kr_all = self.cached_latents(c, k_rope, info)
            k, v = self.expand(c_all, kr_all)
            mask = indices_to_mask(idx, c_all.size(1)).unsqueeze(1)  # [b, 1, s, T]
            out = self.core(torch.cat([q_nope, q_rope], dim=-1), k, v, mask=mask)
        else:
            c, q_lat = comm.copy_to(c, self.tp_group), self.absorbed_query(q_nope)
            if cp is not None:  # long sequences: checkpointed query tiles bound the gathered latents
                c_all, kr_all = cp.gather(c), cp.gather(k_rope)
                if info.cache is not None:  # a prefill: every rank's latents, or this rank's (a split cache)
                    info.cache.layer(self.layer_number).append_prefill(cp, {"c": c, "k_rope": k_rope},
                                                                       {"c": c_all, "k_rope": kr_all})
                o_lat = tiled_sparse_latent_attention(self.sparse_core, q_lat, q_rope, c_all, kr_all, idx, self.scale)
            elif info.cache is not None:  # decoding: the cache attends over the selected latents it keeps
                o_lat = info.cache.layer(self.layer_number).attend_selected(info.cache, q_lat, q_rope, c, k_rope, idx,
                                                                            self.sparse_core, self.scale)
            else:
                o_lat = self.sparse_core(q_lat, q_rope, c, k_rope, idx, self.scale)
            out = self.absorbed_output(o_lat)
        return self.finish(out, x)


class SharedSelectionMLA(SparseMLA):
    """GLM-5's ``shared`` indexer layer (letter ``R``): MLA over the keys the nearest earlier
    ``D`` layer of this forward selected; it has no indexer of its own. x: [b, s, h] -> same."""

    def __init__(self, cfg: MLAConfig, ctx: BuildContext, layer_number: int = 0):
        MultiLatentAttention.__init__(self, cfg, ctx, layer_number)
        self.dense_reference = False
        self.sparse_core = ctx.backend.sparse_latent_attention(ctx)

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        q_nope, q_rope, _, c, k_rope = self.project(x, info)
        return self.attend(x, info, q_nope, q_rope, c, k_rope, shared_selection(info, self.layer_number))


def shared_selection(info: ForwardInfo, layer_number: int) -> torch.Tensor | None:
    """The selection [b, s, K] of the nearest ``D`` layer before ``layer_number`` in this forward
    (None during the indexer's dense warm-up: that layer attended to every key, and so does this one)."""
    earlier = [key[1] for key in info.memo if key[0] == SELECTION and key[1] < layer_number]
    if not earlier:
        raise ConfigError(f"layer {layer_number} ('R') reuses the selection of an earlier 'D' layer, but none ran "
                          "before it in this forward (model.layout: put a D layer first in its pipeline stage)")
    return info.memo[(SELECTION, max(earlier))]


register_mixer("D", ModuleSpec(SparseMLA))
register_mixer("R", ModuleSpec(SharedSelectionMLA))
register_mixer("I", ModuleSpec(SparseMLA, params={"pooled": True}))
