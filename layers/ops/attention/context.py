"""Softmax attention across a context-parallel group, and masks from global positions.

Masks (True = may attend) are built from the tokens' global positions, so one rule serves the
single-process run, a CP rank's two chunks and a packed sequence::

    allowed[q, k] = k <= q  and  (window == 0 or k > q - window)  and  doc[q] == doc[k]

Ring attention (``ring_attention``; letters A and S under CP). Each rank keeps its queries; the
K/V blocks (the two chunks a rank holds) travel once around the CP ring, and each block is
merged into the running output with its log-sum-exp (online softmax). Work is done per
(query chunk, key chunk) pair by a tile kernel (``tiles.py``, the backend's ``attention_tiles``
role): a pair every key of which is visible, or the causal diagonal, is one call of a fused
kernel that returns the log-sum-exp (no scores held); a pair a sliding window or packed
documents cut through is split into tiles of at most ``TILE`` tokens a side, each again fused
when it can be and otherwise run in math form (the masked ones), and a tile that its mask
leaves empty is skipped. So with the 2·CP load-balanced chunks every rank computes the same
number of causal tiles, and a sliding window computes only the tiles it reaches. The backward
runs each tile's backward kernel with the whole row's output and log-sum-exp (the tiles'
gradients then add up) and passes (K, V) and the accumulating (dK, dV) around the ring once
more; dK/dV arrive back at their owner after CP hops. Why a ring and not an all-gather of
K/V: a rank never holds more than two blocks (memory stays O(S/CP)), and the next block's
transfer overlaps the current block's compute.

A sliding window that reaches at most one chunk back (``halo_fits``) needs no ring: each rank
all-gathers only the last window-1 K/V rows of its chunks (``halo_window_attention``).

MLA (M, D, I) all-gathers its latents instead (``tiled_latent_attention`` for M): see
docs/mixers.md "Context parallelism: softmax attention" for the choice per mixer.

Shapes: q [b, s, Hq, d], k [b, s, Hk, d], v [b, s, Hk, dv] (s = this rank's 2 chunks, local
order); inside, [b, H, s, d], and GQA never expands K/V on CPU.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils.checkpoint import checkpoint

from megamoe.parallel import comm
from megamoe.core.errors import ConfigError, DataError
from megamoe.layers.ops.attention.tiles import MATH

TILE = 1024  # tokens per side of a score tile


def context_shard(info):
    """The forward's ``ContextShard`` when it spans more than one rank, else None. With a decode
    cache this is a prefill under CP (the model sets ``cp`` only for a cache's first forward, rows
    of equal length): the mixer attends as in training and hands its keys to the cache
    (``LayerState.append_prefill``: all-gathered, or this rank's share in a split cache), so the
    decode steps that follow run the same on every CP rank."""
    cp = info.cp
    if cp is None or cp.size == 1:
        return None
    if info.cache is not None and (info.cache.seen > 0 or info.cache.pad is not None):
        raise ConfigError("context parallelism with a decode cache: only a first forward (prefill) of rows of "
                          "equal length")
    return cp


def check_documents(documents: torch.Tensor | None, batch: int, seq_len: int) -> None:
    """One line when packed-document ids do not cover the batch's full sequences."""
    if documents is not None and tuple(documents.shape) != (batch, seq_len):
        raise DataError(f"documents has shape {list(documents.shape)}, expected [{batch}, {seq_len}] "
                        "(one document id per token of the full sequence)")


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0,
                 q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """q_pos [tq], k_pos [tk] global positions; q_doc [b, tq], k_doc [b, tk] document ids (or None)
    -> bool [1 or b, tq, tk], True = the query may attend the key."""
    q, k = q_pos[:, None], k_pos[None, :]
    allowed = k <= q
    if window > 0:
        allowed = allowed & (k > q - window)
    allowed = allowed.unsqueeze(0)
    if q_doc is not None:
        allowed = allowed & (q_doc[:, :, None] == k_doc[:, None, :])
    return allowed


def document_mask(documents: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  window: int = 0) -> torch.Tensor:
    """``allowed_mask`` with the documents [b, S] (global order) looked up at the positions."""
    if documents is None:
        return allowed_mask(q_pos, k_pos, window)
    return allowed_mask(q_pos, k_pos, window, documents[:, q_pos], documents[:, k_pos])


# ---- the ring --------------------------------------------------------------------------------

class _RingTransfer:
    """Send ``tensors`` (one dtype) to the next rank of the ring and receive the previous rank's
    (same shapes) without blocking; ``wait()`` returns the received tensors. Transfers in flight
    at the same time are posted in the same order on every rank (NCCL matches them by order,
    gloo by tag; they use different tags)."""

    def __init__(self, tensors: list[torch.Tensor], group, tag: int = 0):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.shapes = [t.shape for t in tensors]
        self.sent = torch.cat([t.reshape(-1) for t in tensors])
        self.got = torch.empty_like(self.sent)
        nxt, prv = (dist.get_global_rank(group, (rank + o) % size) for o in (1, -1))
        self.timer = comm.p2p_timer(group, [self.sent, self.got], "ring")  # sampled training steps only
        if "nccl" in str(dist.get_backend(group)):
            # one batch: NCCL posts the send and the receive together (a lone isend waiting for its
            # peer's irecv, queued behind the peer's own isend, would deadlock the ring)
            self.reqs = dist.batch_isend_irecv([dist.P2POp(c10d.isend, self.sent, nxt, group, tag),
                                                dist.P2POp(c10d.irecv, self.got, prv, group, tag)])
        else:  # gloo: plain non-blocking pairs (what batch_isend_irecv would issue anyway)
            self.reqs = [dist.isend(self.sent, nxt, group=group, tag=tag),
                         dist.irecv(self.got, prv, group=group, tag=tag)]
        if self.timer is not None:
            self.timer.pause()

    def wait(self) -> list[torch.Tensor]:
        if self.timer is not None:
            self.timer.resume()
        for r in self.reqs:
            r.wait()
        if self.timer is not None:
            self.timer.finish()
        parts = self.got.split([s.numel() for s in self.shapes])
        return [p.view(s) for p, s in zip(parts, self.shapes)]


class _Blocks:
    """The tiles one ring step computes: for the block that came from rank ``src``, each
    (query chunk, key chunk) pair as one tile when the fused kernel can take it whole (every key
    visible, or the causal diagonal), else cut into tiles of at most ``tile`` x ``tile`` tokens,
    each again whole-or-causal (fused) or masked (math tiles, whose transient scores are bounded
    to ``b Hq tile^2`` numbers whatever the chunk length); tiles the mask leaves empty are skipped."""

    def __init__(self, cp, window: int, documents: torch.Tensor | None, device, tile: int):
        self.cp, self.window, self.documents, self.device, self.tile = cp, window, documents, device, tile

    def pairs(self, src: int):
        """Yield (query slice, key slice, causal, mask [1|b, 1, tq, tk] or None), local slices."""
        n = self.cp.chunk_len
        for i, (qa, _) in enumerate(self.cp.chunk_bounds(self.cp.rank)):
            for j, (ka, _) in enumerate(self.cp.chunk_bounds(src)):
                yield from self._tiles(i * n, qa, n, j * n, ka, n)

    def kind(self, qa: int, nq: int, ka: int, nk: int) -> str:
        """'empty', 'full', 'causal' or 'masked' for queries at global [qa, qa+nq), keys [ka, ka+nk)."""
        w = self.window
        if ka > qa + nq - 1 or (w and ka + nk - 1 <= qa - w):
            return "empty"  # causal / window: nothing to see
        docs = self.documents
        if docs is not None:  # one document over both ranges (ids are non-decreasing): no document mask
            lo, hi = min(qa, ka), max(qa + nq, ka + nk) - 1
            if not bool((docs[:, lo] == docs[:, hi]).all()):
                return "masked"
        if ka + nk - 1 <= qa and (not w or ka > qa + nq - 1 - w):
            return "full"
        if ka == qa and nk == nq and (not w or nq <= w):
            return "causal"
        return "masked"

    def _tiles(self, ql: int, qa: int, nq: int, kl: int, ka: int, nk: int):
        kind = self.kind(qa, nq, ka, nk)
        if kind == "empty":
            return
        if kind != "masked":
            yield slice(ql, ql + nq), slice(kl, kl + nk), kind == "causal", None
        elif nq <= self.tile and nk <= self.tile:
            mask = document_mask(self.documents, torch.arange(qa, qa + nq, device=self.device),
                                 torch.arange(ka, ka + nk, device=self.device), self.window)  # [1|b, tq, tk]
            if mask.any():
                yield slice(ql, ql + nq), slice(kl, kl + nk), False, mask[:, None]
        else:
            for t in range(0, nq, self.tile):
                for u in range(0, nk, self.tile):
                    yield from self._tiles(ql + t, qa + t, min(self.tile, nq - t),
                                           kl + u, ka + u, min(self.tile, nk - u))


def _merge(out, lse, qs, blk_out, blk_lse) -> None:
    """Fold one tile's (output, log-sum-exp) into the running ones at query slice ``qs`` (in place)."""
    old = lse[..., qs]
    new = torch.logaddexp(old, blk_lse)
    safe = torch.where(torch.isinf(new), 0.0, new)  # rows that have seen nothing yet stay 0
    out[..., qs, :] = out[..., qs, :] * torch.exp(old - safe)[..., None] + blk_out * torch.exp(blk_lse - safe)[..., None]
    lse[..., qs] = new


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, window, cp, documents, tile, kernel):
        # q [b, Hq, s, d], k [b, Hk, s, d], v [b, Hk, s, dv] (local order)
        blocks = _Blocks(cp, window, documents, q.device, tile)
        out = torch.zeros(*q.shape[:-1], v.size(-1), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            transfer = _RingTransfer(kv, cp.group) if step < cp.size - 1 else None  # overlaps the compute
            kb, vb = kv
            for qs, ks, causal, mask in blocks.pairs(src):
                blk_out, blk_lse = kernel.forward(q[:, :, qs], kb[:, :, ks], vb[:, :, ks], scale, causal, mask)
                _merge(out, lse, qs, blk_out, blk_lse)
            kv = transfer.wait() if transfer else None
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.window, ctx.cp, ctx.documents, ctx.tile, ctx.kernel = scale, window, cp, documents, tile, kernel
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale, kernel = ctx.cp, ctx.scale, ctx.kernel
        blocks = _Blocks(cp, ctx.window, ctx.documents, q.device, ctx.tile)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        kb, vb = k, v
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            kv_next = _RingTransfer([kb, vb], cp.group) if step < cp.size - 1 else None
            for qs, ks, causal, mask in blocks.pairs(src):
                # the whole row's output and log-sum-exp: the tiles' gradients add up
                g = kernel.backward(d_out[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks], out[:, :, qs],
                                    lse[:, :, qs], scale, causal, mask)
                dq[:, :, qs] += g[0]
                dk[:, :, ks] += g[1]
                dv[:, :, ks] += g[2]
            # dK/dV travel with their block; after cp.size hops they are back with the owner
            dk, dv = _RingTransfer([dk, dv], cp.group, tag=1).wait()
            if kv_next:
                kb, vb = kv_next.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, scale: float, window: int, cp, documents: torch.Tensor | None = None,
                   tile: int | None = None, kernel=MATH):
    """Causal (optionally windowed, document-masked) attention of this rank's queries over the whole
    sequence, each tile run by ``kernel`` (``megamoe.layers.ops.attention.tiles``).
    q [b, s, Hq, d], k [b, s, Hk, d], v [b, s, Hk, dv] -> [b, s, Hq, dv]."""
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [b, H, s, d]
    out = RingAttention.apply(q, k, v, scale, window, cp, documents, tile or TILE, kernel)
    return out.transpose(1, 2)


# ---- sliding window: a halo instead of the ring ----------------------------------------------------

def halo_fits(window: int, cp) -> bool:
    """Whether each chunk's window reaches only into the chunk before it (the halo exchange works)."""
    return 0 < window - 1 <= cp.chunk_len


def halo_window_attention(core, q, k, v, window: int, cp, documents: torch.Tensor | None = None):
    """``S`` under CP when ``halo_fits``: a chunk's queries see at most the ``window - 1`` keys
    before the chunk, so every rank all-gathers only the last ``window - 1`` K/V rows of each of
    its chunks (bytes independent of the sequence length) and attends each local chunk over
    [halo | chunk] with ``core`` (the ``core_attention`` role, masks from global positions).
    The all-gather's backward reduce-scatters the halo gradients to their owners.
    q [b, s, Hq, d], k [b, s, Hk, d], v [b, s, Hk, dv] -> [b, s, Hq, dv]."""
    n, h, dk = cp.chunk_len, window - 1, k.size(-1)
    kv = torch.cat([k, v], dim=-1)  # [b, s, Hk, d + dv]
    tails = torch.cat([kv[:, n - h:n], kv[:, 2 * n - h:]], dim=1)  # [b, 2h, ...]: front tail | back tail
    tails = comm.gather_reduce_scatter(tails, 1, cp.group)  # [b, P * 2h, ...] rank-major

    def tail_of(chunk: int) -> torch.Tensor:
        start = cp.gathered_slot(chunk) * h
        return tails[:, start:start + h]

    outs = []
    for i, (a, b) in enumerate(cp.chunk_bounds()):
        chunk = a // n
        keys = kv[:, i * n:(i + 1) * n]
        k_pos = torch.arange(a, b, device=q.device)
        if chunk > 0:
            keys = torch.cat([tail_of(chunk - 1), keys], dim=1)
            k_pos = torch.cat([torch.arange(a - h, a, device=q.device), k_pos])
        mask = document_mask(documents, torch.arange(a, b, device=q.device), k_pos, window)  # [1|b, n, tk]
        outs.append(core(q[:, i * n:(i + 1) * n], keys[..., :dk], keys[..., dk:], mask=mask.unsqueeze(1)))
    return torch.cat(outs, dim=1)


# ---- MLA's absorbed attention over all-gathered latents -----------------------------------------

def tile_rows(keys: int, queries: int = 0) -> int:
    """Query rows per pass so that a pass scores about TILE^2 (query, key) pairs (at least 16).
    ``queries`` (when given) <= 16: all of them, the same single pass, decided without the key
    count (in a compiled decode step a symbolic one: no guard, no recompile as the cache grows)."""
    return queries if 0 < queries <= 16 else max(16, TILE * TILE // keys)


def _latent_tile(core, q_lat, q_rope, c, k_rope, scale, q_pos, documents):
    """One query tile against the latents it can reach (keys up to its last position)."""
    end = int(q_pos.max()) + 1
    mask = document_mask(documents, q_pos, torch.arange(end, device=q_pos.device))
    return core(q_lat, q_rope, c[:, :end], k_rope[:, :end], scale, mask)


def tiled_latent_attention(core, q_lat, q_rope, c, k_rope, scale: float, q_pos: torch.Tensor,
                           documents: torch.Tensor | None = None) -> torch.Tensor:
    """``core`` (the ``latent_attention`` role) for queries at global positions ``q_pos`` [s] over
    the whole sequence's latents c [b, S, r], k_rope [b, S, dr], in query tiles of about
    ``TILE^2 / S`` rows, each recomputed in the backward (activation checkpointing): neither
    the [s, S] mask nor the [b, s, H, S] scores are ever held whole. -> [b, s, H, r]."""
    check_documents(documents, q_lat.size(0), c.size(1))
    rows = tile_rows(c.size(1), q_lat.size(1))
    outs = [checkpoint(_latent_tile, core, q_lat[:, a:a + rows], q_rope[:, a:a + rows], c, k_rope, scale,
                       q_pos[a:a + rows], documents, use_reentrant=False)
            for a in range(0, q_lat.size(1), rows)]
    return torch.cat(outs, dim=1)


def tiled_sparse_latent_attention(core, q_lat, q_rope, c, k_rope, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """``core`` (the ``sparse_latent_attention`` role) in checkpointed query tiles of about
    ``TILE^2 / K`` rows (idx [b, s, K]): the [b, rows, K, r] latents each tile gathers exist
    for one tile at a time and are not kept for the backward. -> [b, s, H, r]."""
    rows = tile_rows(idx.size(-1), q_lat.size(1))
    outs = [checkpoint(core, q_lat[:, a:a + rows], q_rope[:, a:a + rows], c, k_rope, idx[:, a:a + rows], scale,
                       use_reentrant=False)
            for a in range(0, q_lat.size(1), rows)]
    return torch.cat(outs, dim=1)
