"""DeepSeek-V4 attention (W, C, H) under context parallelism (``ForwardInfo.cp``, a ``ContextShard``:
rank r holds chunks r and 2·CP-1-r of n = S / 2·CP tokens), and its prefill into a decode cache.

Each rank needs, for its two chunks, what lies before them:

- the window: the last ``window - 1`` keys before each chunk (a halo);
- the blocks that end inside the chunk but start before it (a block straddling the border) and,
  for CSA, the block before each of them: the last ``2 rate - 1`` (CSA) or ``rate - 1`` (HCA)
  compressor and indexer rows before the chunk;
- every entry of the sequence (HCA attends to all earlier ones; the CSA indexer ranks all
  earlier ones and any may be chosen).

So one all-gather brings every chunk's last L = max(window - 1, rows needed) rows ``[kv |
compressor rows | indexer rows]`` (``ChunkTails``; its backward reduce-scatters the halo
gradients to their owners; when L exceeds a chunk, short sequences, the rows are all-gathered
whole instead). Each rank then pools the blocks that END in its chunks (halo + chunk as one
segment) and a second all-gather assembles every entry in sequence order: the block table of
the whole sequence is known on every rank (from the documents, or the length), so each block's
slot in the gather is computed, not sent. Entries travel with gradient (the gather's backward
reduce-scatters); indexer keys without.

Bytes each rank sends per layer: 2 L (D + F) for the halos (F: compressor rows, 4D for CSA
plus 4 Di for its indexer, 2D for HCA) and 2 Nc (D [+ Di]) for the entries, Nc the most blocks
ending in one chunk (about n / rate).

Prefill with a cache under CP: every rank stores the whole sequence's state (the last window - 1
keys and pending rows from the last chunk's tail, every entry), as one process would.
"""
from __future__ import annotations

import torch

from megamoe.layers.ops.attention.context import context_shard  # noqa: F401  (re-exported for the mixer)
from megamoe.layers.ops.compressed_attention import EMPTY, Entries, find_blocks
from megamoe.parallel import comm
from megamoe.parallel.context import position_in_document


class ChunkTails:
    """The last ``length`` rows of every global chunk of x [b, 2n, F] (local order), on every rank."""

    def __init__(self, x: torch.Tensor, length: int, cp):
        self.cp, self.length, n = cp, length, cp.chunk_len
        self.empty = x.new_zeros(x.size(0), 0, x.size(-1))
        self.full = None
        if length > n:  # a short sequence: the rows before a chunk reach into several chunks
            self.full = cp.gather(x)
        elif length > 0:
            self.tails = comm.gather_reduce_scatter(torch.cat([x[:, n - length:n], x[:, 2 * n - length:]], dim=1),
                                                    1, cp.group)  # [b, P * 2 length, F] rank-major

    def before(self, start: int, length: int) -> torch.Tensor:
        """The rows [start - length, start) (fewer at the sequence start), length <= self.length."""
        take = min(length, start)
        if self.full is not None:
            return self.full[:, start - take:start]
        if take == 0:
            return self.empty
        slot = self.cp.gathered_slot(start // self.cp.chunk_len - 1)
        return self.tails[:, (slot + 1) * self.length - take:(slot + 1) * self.length]


def sequence_positions(info, seq_len: int, batch: int, device) -> torch.Tensor:
    """[b, S] every token's position in its document (the whole sequence)."""
    if info.documents is not None:
        return position_in_document(info.documents)
    return torch.arange(seq_len, device=device).expand(batch, -1)


def gathered_slots(valid: torch.Tensor, start: torch.Tensor, rate: int, cp, per_chunk: int) -> torch.Tensor:
    """Where each block of the whole sequence's table ([b, N], in order) sits in the all-gather of
    every rank's per-chunk entry lists (``per_chunk`` slots each, rank-major [front | back])."""
    p2 = 2 * cp.size
    chunk = torch.where(valid, (start + rate - 1) // cp.chunk_len, p2)  # non-decreasing along each row
    first = torch.searchsorted(chunk.contiguous(), chunk.contiguous())  # each row's first block of that chunk
    within = torch.arange(chunk.size(1), device=chunk.device) - first
    gathered = torch.where(chunk < cp.size, 2 * chunk, 2 * (p2 - 1 - chunk) + 1)
    return torch.where(valid, gathered * per_chunk + within, 0)


def chunk_entries(mixer, tails: ChunkTails, rows: torch.Tensor, p_all: torch.Tensor, docs, cp):
    """Every entry of the sequence (values with gradient, the indexer's keys without) and valid [b, N]."""
    n, rate, d = cp.chunk_len, mixer.rate, mixer.dim
    need = (2 if mixer.indexer is not None else 1) * rate - 1
    table = find_blocks(p_all, rate)
    # blocks are disjoint: at most one ends in a chunk after starting before it, the rest lie in it
    per_chunk = n // rate + 1
    values, keys = [], []
    for i, (a, e) in enumerate(cp.chunk_bounds()):
        halo = tails.before(a, need)[..., d:]
        seg = torch.cat([halo, rows[:, i * n:(i + 1) * n]], dim=1)
        off = a - halo.size(1)
        ent, key, _ = mixer.entries(seg, p_all[:, off:e], off, first_end=halo.size(1))
        values.append(_fit(ent.values, per_chunk))
        keys.append(None if key is None else _fit(key.values, per_chunk))
    slot = gathered_slots(table.valid, table.start, rate, cp, per_chunk)
    batch = torch.arange(p_all.size(0), device=rows.device)[:, None]
    all_values = comm.gather_reduce_scatter(torch.cat(values, dim=1), 1, cp.group)[batch, slot]
    end = torch.where(table.valid, table.start + rate - 1, EMPTY)
    doc = None if docs is None else docs.gather(1, table.start)
    all_keys = None
    if keys[0] is not None:
        with torch.no_grad():
            all_keys = Entries(comm.gather_reduce_scatter(torch.cat(keys, dim=1), 1, cp.group)[batch, slot], end, doc)
    return Entries(all_values, end, doc), all_keys, table.valid


def _fit(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [b, N, ...] (valid slots first) -> [b, width, ...]: empty slots cut or zeros added."""
    x = x[:, :width]
    return torch.cat([x, x.new_zeros(x.size(0), width - x.size(1), *x.shape[2:])], dim=1)


def context_forward(mixer, x: torch.Tensor, info, cp) -> torch.Tensor:
    """This rank's two chunks of x [b, 2n(/tp), h] -> the attention outputs [b, 2n, H, D]."""
    q, kv, q_latent, rows = mixer.project(x, info)
    b, n, s_len, d = q.size(0), cp.chunk_len, cp.seq_len, mixer.dim
    need = 0 if rows is None else (2 if mixer.indexer is not None else 1) * mixer.rate - 1
    tails = ChunkTails(kv if rows is None else torch.cat([kv, rows], dim=-1), max(mixer.window - 1, need), cp)
    docs = info.documents
    entries = keys = valid = None
    if rows is not None:
        p_all = sequence_positions(info, s_len, b, x.device)
        entries, keys, valid = chunk_entries(mixer, tails, rows, p_all, docs, cp)
    q_pos = cp.local_index(x.device)
    select = mixer.select(x, q_latent, keys, q_pos, None if docs is None else docs[:, q_pos], info)
    outs = []
    for i, (a, e) in enumerate(cp.chunk_bounds()):
        halo = tails.before(a, mixer.window - 1)[..., :d]
        part = slice(i * n, (i + 1) * n)
        outs.append(mixer.attend(q[:, part], torch.cat([halo, kv[:, part]], dim=1), entries,
                                 None if select is None else select[:, part], q_start=a, kv_start=a - halo.size(1),
                                 q_doc=None if docs is None else docs[:, a:e],
                                 kv_doc=None if docs is None else docs[:, a - halo.size(1):e]))
    if info.cache is not None:  # a prefill: the cache holds the whole sequence's state
        store_prefill(mixer, info.cache.layer(mixer.layer_number), kv, cp, tails, entries, keys, valid, s_len, need)
    return torch.cat(outs, dim=1)


@torch.no_grad()
def store_prefill(mixer, state, kv: torch.Tensor, cp, tails: ChunkTails, entries, keys, valid, seq_len: int,
                  need: int) -> None:
    """The cache after the whole sequence: its keys (all of them, so that a paged cache keeps its
    time axis; the window then trims them), pending rows, entries."""
    d = mixer.dim
    state.append_time("kv", cp.gather(kv.detach()))
    state.keep_last(("kv",), mixer.window - 1)
    if entries is not None:
        state["pending"] = tails.before(seq_len, need)[..., d:].detach()
        mixer.store_entries(state, entries, keys, valid)
