"""DeepSeek-V4 attention: layout letters ``W`` (sliding window), ``C`` (compressed sparse, CSA) and
``H`` (heavily compressed, HCA); section ``model.compressed``.

One key/value head of D channels (keys are values), H query heads from a query latent::

    q_lat = norm(W_qa x)                       q = rms(W_qb q_lat) per head       [b, s, H, D]
    kv = norm(W_kv x)                                                             [b, s, D]
    q, kv: RoPE on the last dr channels (interleaved pairs, positions of the tokens)
    o = softmax over [window keys (t - W, t] | entries | sink_h] of q . k * D^-1/2, times [kv | e]
    o: RoPE at the query's position turned back on the last dr channels (kv was rotated as a value)
    y = W_ob grouped(o)                        grouped: o_groups blocks of heads, W_oa each

Entries (``compressed_parts.Compressor``): ``C`` pools blocks of ``csa_rate`` tokens overlapping
by one block and each query attends only to the ``indexer.topk`` entries its lightning indexer
picks; ``H`` pools blocks of ``hca_rate`` tokens and each query attends to every entry whose
block ended at or before it. ``W`` has none. RoPE bases: ``rope_theta`` for W layers,
``compress_rope_theta`` with YaRN frequencies for C and H (queries, keys, entries and the
indexer; cos/sin unscaled, as V4 does).

Which tokens form blocks: per document, from its first token (``ForwardInfo.documents``; a
left-padded decode batch cuts blocks from each row's first real token), so packed documents run
as they would alone. The attention is the ``compressed_attention`` role (query tiles that never
hold [query x key] scores; ``ops.compressed_attention``).

TP splits heads (and whole output groups); the latent, key and compressor projections are
replicated (``replicated_linear``): their outputs feed every rank's heads, through
``comm.copy_to`` where no column-parallel linear sums their gradient. Context parallelism:
``megamoe.layers.mixers.compressed_context``. Decode state (``cache.layer(n)``): the last window-1
keys ``kv``, the entries ``entries`` (+ the indexer's ``index_keys``) on their own axis with
their blocks' ends ``entry_end``, and the rows of tokens whose block is still incomplete
``pending`` (at most 2*rate - 1 with overlap, rate - 1 without). CSA reads its indexer keys a
cache tile at a time (``LayerState.entry_tiles``) and only the selected entries
(``select_entries``), HCA its entries through ``attend_entries`` (a quantised cache a tile at a
time, ``tiled_entries_decode``), so a quantised cache is never dequantised whole.

Parameters per layer (h hidden, r_q, H, D, G groups, r_o): h r_q + r_q + r_q H D + h D + D + H
+ H D r_o + G r_o h + compressor [+ indexer] (``compressed_parts``).
"""
from __future__ import annotations

from dataclasses import astuple

import torch
from torch import nn

from megamoe.layers.cache.decode import append_right
from megamoe.core.config import CompressedAttentionConfig, YarnConfig
from megamoe.core.errors import ConfigError
from megamoe.layers.mixers.compressed_context import context_forward, context_shard
from megamoe.layers.mixers.compressed_parts import CompressedIndexer, Compressor, GroupedProjection
from megamoe.layers.ops.compressed_attention import EMPTY, Entries, find_blocks
from megamoe.layers.ops.compressed_attention.tiled import tiled_entries_decode
from megamoe.layers.rotary import apply_rotary_pairs, inv_freq, yarn_inv_freq
from megamoe.parallel import comm
from megamoe.parallel.context import position_in_document
from megamoe.parallel.sharding import Shard, const_init, mark_init, set_sharding
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mixer

KINDS = {"window": "W", "csa": "C", "hca": "H"}


def rope_tables(positions: torch.Tensor, rot: int, theta: float, yarn) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> (cos, sin) [..., rot] fp32 (``cat(freqs, freqs)``); YaRN frequencies when
    ``yarn.factor > 1`` (no cos/sin scale: DeepSeek-V4 sets attention_factor 1)."""
    freq = yarn_inv_freq(yarn, rot, theta, positions.device) if yarn.factor > 1 else inv_freq(rot, theta,
                                                                                               positions.device)
    angles = positions.to(torch.float64).unsqueeze(-1) * freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float(), emb.sin().float()


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim (no weight), statistics in fp32, in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class CompressedAttention(nn.Module):
    """x [b, s, h] (``[b, s/tp, h]`` under SP) -> same. ``kind``: window | csa | hca."""

    def __init__(self, cfg: CompressedAttentionConfig, ctx: BuildContext, layer_number: int = 0, *, kind: str):
        super().__init__()
        if kind == "csa" and cfg.indexer is None:
            raise ConfigError("model.compressed.indexer is not set but model.layout uses 'C' (compressed sparse "
                              "attention needs the indexer settings)")
        self.kind, self.layer_number = kind, layer_number
        tp, H, D, h = ctx.groups.tp_size, cfg.num_heads, cfg.head_dim, ctx.hidden_size
        self.heads, self.dim, self.rot, self.window = H // tp, D, cfg.rope_head_dim, cfg.sliding_window
        self.eps = cfg.norm_eps or ctx.norm_eps
        self.tp_group = ctx.groups.tp
        self.theta, self.yarn = ((cfg.rope_theta, YarnConfig()) if kind == "window"
                                 else (cfg.compress_rope_theta, cfg.yarn))
        self.rate = {"window": 0, "csa": cfg.csa_rate, "hca": cfg.hca_rate}[kind]
        b = ctx.backend
        self.linear_q_down = b.replicated_linear(ctx, h, cfg.q_lora_rank)
        self.q_norm = b.norm(ctx, cfg.q_lora_rank, eps=self.eps, zero_centered=False)
        self.linear_q = b.column_linear(ctx, cfg.q_lora_rank, H * D, sequence_parallel=False)
        self.linear_kv = b.replicated_linear(ctx, h, D)
        self.kv_norm = b.norm(ctx, D, eps=self.eps, zero_centered=False)
        self.sinks = nn.Parameter(torch.empty(H // tp, dtype=ctx.dtype, device=ctx.device))
        set_sharding(self.sinks, Shard(0, "tp"))
        mark_init(self.sinks, const_init(0.0))
        self.linear_out_groups = GroupedProjection(ctx, cfg.o_groups, H * D // cfg.o_groups, cfg.o_lora_rank)
        self.linear_proj = b.row_linear(ctx, cfg.o_groups * cfg.o_lora_rank, h)
        self.compressor = None if kind == "window" else Compressor(ctx, D, self.rate, kind == "csa", self.eps)
        self.indexer = (CompressedIndexer(cfg.indexer, ctx, cfg.q_lora_rank, self.rate, self.eps)
                        if kind == "csa" else None)
        self.scale = D ** -0.5
        self.core = b.compressed_attention(ctx)

    # ---- pieces -----------------------------------------------------------------------------

    def tables(self, positions: torch.Tensor, info: ForwardInfo | None = None):
        """RoPE (cos, sin) at ``positions``; the queries' (``info.positions``) once per forward."""
        if info is None:
            return rope_tables(positions, self.rot, self.theta, self.yarn)
        key = ("rope-pairs", self.rot, self.theta, *astuple(self.yarn))
        if key not in info.memo:
            pos = info.positions
            info.memo[key] = rope_tables(pos[0] if pos.dim() == 3 else pos, self.rot, self.theta, self.yarn)
        return info.memo[key]

    def project(self, x: torch.Tensor, info: ForwardInfo):
        """x -> q [b, s, H, D], kv [b, s, D] (both rotated), the query latent [b, s, r_q], rows of
        the compressor (and indexer) [b, s, F] (None for W)."""
        cos, sin = self.tables(info.positions, info)
        q_latent = self.q_norm(self.linear_q_down(x))
        q = self.linear_q(q_latent)
        q = unit_rms(q.view(*q.shape[:2], self.heads, self.dim), self.eps)
        kv = self.kv_norm(self.linear_kv(x))
        kv = apply_rotary_pairs(kv.unsqueeze(2), cos, sin).squeeze(2)
        rows = None
        if self.compressor is not None:
            rows = self.compressor.rows(x)
            if self.indexer is not None:
                with torch.no_grad():  # the indexer is trained by no gradient here (indices only)
                    index_rows = self.indexer.compressor.rows(x)
                rows = torch.cat([rows, index_rows], dim=-1)
        return apply_rotary_pairs(q, cos, sin), comm.copy_to(kv, self.tp_group), q_latent, rows

    def entries(self, rows: torch.Tensor, p: torch.Tensor, offset: int, first_end: int = 0,
                doc: torch.Tensor | None = None):
        """The entries of the blocks complete in a segment of ``rows`` [b, T, F] (positions in
        their documents ``p`` [b, T], row 0 at index ``offset`` of the queries' axis) whose last
        row is at or after ``first_end`` -> (entries, the indexer's keys or None, valid [b, N])."""
        blocks = find_blocks(p, self.rate, first_end)
        tables = self.tables(blocks.pos)
        width = 2 * self.compressor.width
        values = comm.copy_to(self.compressor.pool(rows[..., :width], blocks, tables), self.tp_group)
        end = torch.where(blocks.valid, offset + blocks.start + self.rate - 1, EMPTY)
        ent_doc = None if doc is None else doc.gather(1, blocks.start)
        keys = None
        if self.indexer is not None:
            with torch.no_grad():
                keys = self.indexer.compressor.pool(rows[..., width:], blocks, tables)
            keys = Entries(keys, end, ent_doc)
        return Entries(values, end, ent_doc), keys, blocks.valid

    def finish(self, o: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        """o [b, s, H, D] -> the key rotation turned back, grouped projection, output projection."""
        cos, sin = self.tables(info.positions, info)
        o = apply_rotary_pairs(o, cos, -sin)
        return self.linear_proj(self.linear_out_groups(o.reshape(*o.shape[:2], -1)))

    def select(self, x, q_latent, keys: Entries | None, q_pos: torch.Tensor, q_doc, info: ForwardInfo):
        """CSA: the indexer's choice [b, s, K] for queries at ``q_pos`` [s]; None for W and H."""
        if self.indexer is None:
            return None
        return self.indexer.select(x, q_latent, self.tables(info.positions, info), keys, q_pos, q_doc)

    def attend(self, q, kv, entries, select, *, q_start=0, kv_start=0, q_doc=None, kv_doc=None):
        """The ``compressed_attention`` role: q [b, s, H, D] at q_start.., kv [b, T, D] at kv_start.."""
        return self.core(q, kv, entries, self.sinks, self.scale, window=self.window, q_start=q_start,
                         kv_start=kv_start, q_doc=q_doc, kv_doc=kv_doc, select=select)

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        cp = context_shard(info)
        if cp is not None:
            return self.finish(context_forward(self, x, info, cp), info)
        q, kv, q_latent, rows = self.project(x, info)
        if info.cache is not None:
            return self.finish(self.decode(q, kv, q_latent, rows, x, info), info)
        docs = info.documents
        entries = keys = None
        if rows is not None:
            p = position_in_document(docs) if docs is not None else \
                torch.arange(rows.size(1), device=x.device).expand(rows.size(0), -1)
            entries, keys, _ = self.entries(rows, p, 0, doc=docs)
        select = self.select(x, q_latent, keys, torch.arange(q.size(1), device=x.device), docs, info)
        return self.finish(self.attend(q, kv, entries, select, q_doc=docs, kv_doc=docs), info)

    def decode(self, q, kv, q_latent, rows, x, info):
        """A forward with a decode cache: s new tokens after ``cache.seen``, their window over the
        cached keys, the entries of blocks completed before and in this forward."""
        cache, s = info.cache, q.size(1)
        state = cache.layer(self.layer_number)
        t0 = cache.seen
        kv_all = state.append_time("kv", kv.detach())
        state.keep_last(("kv",), self.window - 1)
        pads = cache.pad
        times = torch.arange(t0 + s - kv_all.size(1), t0 + s, device=x.device)
        kv_doc = None if pads is None else (times[None] >= pads.to(x.device)[:, None]).long()
        q_doc = None if kv_doc is None else kv_doc[:, -s:]
        entries = keys = None
        if rows is not None:
            entries, keys = self.cached_entries(state, rows.detach(), t0, pads)
        where = dict(q_start=t0, kv_start=t0 + s - kv_all.size(1), q_doc=q_doc, kv_doc=kv_doc)
        if keys is not None:  # CSA: the indexer reads its keys a cache tile at a time, the attention the chosen entries
            select = self.indexer.select(x, q_latent, self.tables(info.positions, info), keys,
                                         torch.arange(t0, t0 + s, device=x.device), q_doc,
                                         key_tiles=lambda: (t for _, t in state.entry_tiles(("index_keys",))))
            values, select = state.select_entries("entries", select)
            return self.attend(q, kv_all, Entries(values, entries.end), select, **where)
        if entries is not None:  # HCA: every visible entry, whole or (a quantised cache) a tile at a time
            end = entries.end
            return state.attend_entries(
                "entries", lambda values: self.attend(q, kv_all, Entries(values, end), None, **where),
                lambda tiles: tiled_entries_decode(q, kv_all, ((v, end[:, a:a + v.size(1)]) for a, v in tiles),
                                                   self.sinks, self.scale, window=self.window, **where))
        return self.attend(q, kv_all, None, None, **where)

    def cached_entries(self, state, rows: torch.Tensor, t0: int, pads: torch.Tensor | None):
        """Pool the blocks the new rows complete (after the cached pending rows), append them to the
        cache's entries; keep the rows a later block still needs. -> (entries, keys) of the cache."""
        pending = state.get("pending")
        seg = rows if pending is None else torch.cat([pending, rows], dim=1)
        first = seg.size(1) - rows.size(1)
        times = torch.arange(t0 - first, t0 + rows.size(1), device=rows.device)
        p = times[None].expand(rows.size(0), -1)
        if pads is not None:
            p = p - pads.to(rows.device)[:, None]
            p = torch.where(p >= 0, p, -1)
        new, new_keys, valid = self.entries(seg, p, t0 - first, first_end=first)
        keep = (2 if self.indexer is not None else 1) * self.rate - 1
        state["pending"] = seg[:, seg.size(1) - min(keep, seg.size(1)):]
        return self.store_entries(state, new, new_keys, valid)

    def store_entries(self, state, new: Entries, new_keys: Entries | None, valid: torch.Tensor):
        """Append new entries (and indexer keys) [b, n, ...] where ``valid`` to the cache -> the
        cache's (entries, keys or None) with their ends and values None: the values are read through
        the cache (``decode``)."""
        end, counts = append_right(state.get("entry_end"), state.get("entry_end#count"), new.end, valid, fill=EMPTY)
        state["entry_end"], state["entry_end#count"] = end, counts
        state.extend_entries("entries", new.values.detach(), valid)
        if new_keys is None:
            return Entries(None, end), None
        state.extend_entries("index_keys", new_keys.values, valid)
        return Entries(None, end), Entries(None, end)

for _kind, _letter in KINDS.items():
    register_mixer(_letter, ModuleSpec(CompressedAttention, params={"kind": _kind}))
