"""Linear attention (G, K, L) over a sequence that is not all in one piece: context parallelism
by state passing, packed documents by state resets.

Context parallelism (``megamoe.parallel.context``): rank r holds chunks r and 2·CP-1-r of n tokens
each. Per chunk c the recurrence is affine in the state the chunk starts from::

    H_out = M_c H_in + R_c          M_c [hv, dk, dk], R_c [hv, dk, dv]

and the state each chunk starts from is a scan over the chunks in global order (H_0 = 0, or
the decode cache's state) of every rank's (M_c, R_c), exchanged by one all-gather.

Delta rule (G, K): the backend's ``passing`` (``megamoe.layers.ops.delta_rule.passing``) runs
both local chunks as a batch of 2b sequences and exchanges through a ``StateLink``. The per-head
op (G on the cpu backend) passes the states itself, as fla's CP does: its chunk matrices once at
the value's width, one scan of [S(0) | transition] to get (R, M), the exchange, the true states
by one batched product, the outputs as without CP; in backward one reverse scan, an all-gather
of each chunk's start-state gradient, a reverse scan over the chunks with M^T, the op's own
backward. Other ops (K's per-channel op, the local recurrence, fla's kernels) run once with
values [v | 0] from the initial state [0 | I] (outputs [o(0) | M_t^T q_t], final state [R | M]),
and o_t = o_t(0) + (M_t^T q_t) H_in, through an autograd all-gather whose backward
reduce-scatters. Lightning (L): M_c is the scalar exp(-s n) (times 0 when a document starts in
the chunk); the op's final state is R_c. Bytes each rank receives per layer in forward:
2·CP·b·hv·dk·(dk+dv)·4 (G, K; L: 2·CP·b·h·dk·dv·4), whatever the sequence length.

Activation memory (G, K): the per-head op keeps what it keeps without CP (its inputs, the
chunk-start states and its chunk matrices) for the local tokens, and the exchange's transitions;
with ``train.recompute=[core]`` its inputs and incoming states only (backward rebuilds the chunk
matrices and scans from the incoming states at the value's width). The widened form keeps its
op's tensors at width dv + dk and M_t^T q_t [2b, hv, n, dk]; recomputed, its run is
checkpointed (its inputs only, the run again in backward), which holds no collective. The
short convolution keeps what it keeps without CP (its input, a view of the projection, and its
pre-activation) and the small halo.
Lightning runs at normal width and keeps exp(-s t) q_t for the correction. docs/mixers.md
("Context parallelism: linear attention") has the measurements.

Short convolution: every local chunk continues from the last ``kernel - 1`` pre-conv inputs of
the chunk before it (zeros for chunk 0): a second small all-gather, 2·CP·b·(kernel-1)·C values.
The conv role's training form runs each chunk from its halo as its state (the halo's gradient
goes back through the all-gather's reduce-scatter).

Prefill under CP (a decode cache, rows of equal length): the sequence starts from the cache's
``conv`` and recurrent states, and every rank leaves them as after the whole sequence (the scan
runs on to the last chunk; the conv window is the last chunk's tail), so decoding continues
without CP from the usual layout.

Packed documents (``ForwardInfo.documents``, with or without CP): the state is zeroed before the
first token of every document and the convolution reads nothing before it. The delta rule gets a
log decay of ``RESET_LOG_DECAY`` there (exp of it is 0 in fp32 and 1e-87 in float64, and every
backend, fla included, takes it as an ordinary decay); Lightning gets ``resets`` (its ops mask per
token). Under CP a document start inside a chunk zeroes that chunk's M from the start on.

Shapes: local tensors [b, s, ...] with s = 2n under CP (local order: [front chunk | back chunk]);
"chunk batches" [2b, n, ...] (row 2i + j: row i's chunk j).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.core.errors import ConfigError
from megamoe.parallel.comm import all_gather_tensor, gather_reduce_scatter
from megamoe.layers.spec import ForwardInfo

RESET_LOG_DECAY = -200.0  # a document start: the state before it is multiplied by exp(-200)


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """[b, 2n, ...] (local order) -> [2b, n, ...] (one row per local chunk)."""
    return x.reshape(x.size(0) * 2, x.size(1) // 2, *x.shape[2:])


def _unchunk(x: torch.Tensor) -> torch.Tensor:
    """[2b, n, ...] -> [b, 2n, ...]."""
    return x.reshape(x.size(0) // 2, x.size(1) * 2, *x.shape[2:])


class SequenceView:
    """How a linear-attention mixer sees its tokens when they are not one whole sequence:
    ``cp`` (a ContextShard of 2+ ranks, or None) and ``resets`` ([b, s] bool: a document starts at
    this local token, or None). ``full_resets`` [b, S]: the same for the whole sequence. ``state``:
    the layer's decode state under CP (prefill): read as the sequence's start (``conv``, the
    recurrent state) and left, on every rank, as after the whole sequence in the usual layout."""

    def __init__(self, cp, full_resets: torch.Tensor | None, state=None):
        self.cp, self.full_resets, self.state = cp, full_resets, state
        self.resets = None if full_resets is None or cp is None else cp.split(full_resets, 1)
        if cp is None:
            self.resets = full_resets

    @classmethod
    def of(cls, info: ForwardInfo, letter: str, local_len: int, layer_number: int = 0) -> "SequenceView | None":
        """None for a plain sequence (no CP, no packed documents): the mixer's usual path."""
        cp = info.cp if info.cp is not None and info.cp.size > 1 else None
        if cp is None and info.documents is None:
            return None
        state = None
        if info.cache is not None:
            if info.documents is not None:
                raise ConfigError(f"mixer {letter}: packed documents (ForwardInfo.documents) with a decode cache "
                                  f"are not supported")
            if info.cache.pad is not None:
                raise ConfigError(f"mixer {letter}: context parallelism with a left-padded decode cache is not "
                                  f"supported (prefill rows of equal length)")
            state = info.cache.layer(layer_number)
        full_len = local_len if cp is None else cp.seq_len
        resets = None
        if info.documents is not None:
            docs = info.documents
            if docs.dim() != 2 or docs.size(1) != full_len:
                raise ConfigError(f"mixer {letter}: documents has shape {tuple(docs.shape)}, expected [b, {full_len}]")
            resets = F.pad(docs[:, 1:] != docs[:, :-1], (1, 0))
        return cls(cp, resets, state)

    # ---- short convolution ---------------------------------------------------------------

    def conv(self, conv, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """silu(causal depthwise conv) of x [b, s, C] with weight [C, K] -> [b, s, C]; ``conv`` is
        the backend's short-conv role (x, weight, state) -> (y, state)."""
        kernel = weight.size(-1)
        if self.cp is None:
            return masked_conv(x, weight, self.resets)
        start = None if self.state is None else self.state.get("conv")
        halo, last = conv_halo(x, kernel - 1, self.cp, start)
        if self.state is not None:
            self.state["conv"] = last
        halo = halo.flatten(0, 1)                                  # [2b, K-1, C]
        if self.resets is None:  # the role's training form from the halo (its gradient flows back to it)
            return _unchunk(conv(_chunks(x), weight, halo)[0])
        n, width = x.size(1) // 2, kernel - 1                     # the halo's own document starts
        before = F.pad(self.full_resets, (width, 0))               # [b, K-1 + S]
        halo_resets = torch.stack([before[:, c * n:c * n + width] for c in self.cp.chunk_ids()], 1)
        return _unchunk(masked_conv(_chunks(x), weight, _chunks(self.resets), halo, halo_resets.flatten(0, 1)))

    # ---- delta rule (G, K) ---------------------------------------------------------------

    def delta_rule(self, op, q, k, v, g, beta, *, scale=None, chunk_size: int = 64, recompute: bool = False):
        """The backend's chunked delta rule over this view -> o [b, s, hv, dv]: ``op.chunked``
        without CP, ``op.passing`` over the local chunks and a ``StateLink`` under CP. Shapes as in
        ``delta_rule.py``; g [b, s, hv] or [b, s, hv, dk]. ``recompute`` (``train.recompute=[core]``):
        the op keeps only its inputs and rebuilds the rest in backward."""
        if self.resets is not None:
            r = self.resets.view(*self.resets.shape, *([1] * (g.dim() - 2)))
            g = torch.where(r, torch.full((), RESET_LOG_DECAY, dtype=g.dtype, device=g.device), g)
        if self.cp is None:
            return op.chunked(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, recompute=recompute)[0]
        b, hv, dv = v.size(0), v.size(2), v.size(-1)
        link = StateLink(self, b, hv, dv)
        chunked = (_chunks(t) for t in (q, k, v, g, beta))
        return _unchunk(op.passing(*chunked, link, scale=scale, chunk_size=chunk_size, recompute=recompute))

    def _incoming(self, every: torch.Tensor, dv: int, transitions: torch.Tensor | None = None, *,
                  key: str) -> torch.Tensor:
        """The state each local chunk starts from, [b, 2, h, dk, dv]. ``every`` [b, 2CP, h, dk, dv (+ dk)]
        (all-gathered, rank-major): every chunk's R_c (and M_c after it, unless ``transitions``
        [b, 2CP, h, 1, 1] gives every chunk's scalar M_c in global order). The scan runs on every
        rank, from the decode state ``self.state[key]`` if any (then it is left as after the sequence)."""
        cp = self.cp
        h = None if self.state is None else self.state.get(key)
        h = every.new_zeros(*every.shape[:1], *every.shape[2:-1], dv) if h is None else h.to(every.dtype)
        starts = []
        for c in range(2 * cp.size if self.state is not None else max(cp.chunk_ids()) + 1):
            starts.append(h)
            R, M = every[:, cp.gathered_slot(c)].split([dv, every.size(-1) - dv], dim=-1)
            h = (transitions[:, c] * h if transitions is not None else M @ h) + R
        if self.state is not None:
            self.state[key] = h
        return torch.stack([starts[c] for c in cp.chunk_ids()], dim=1)

    def _outgoing(self, every: torch.Tensor, transitions: torch.Tensor) -> torch.Tensor:
        """The backward of ``_incoming`` (delta rule): the gradient of each local chunk's final
        state [b, 2, h, dk, dv], from ``every`` [b, 2CP, h, dk, dv] (all-gathered, rank-major):
        each chunk's rho (the gradient of its start state from its own outputs) and ``transitions``
        [b, 2CP, h, dk, dk] (M_c, as gathered in forward): dH_in(c) = rho_c + M_c^T dH_in(c + 1),
        zero after the last chunk."""
        cp = self.cp
        d = torch.zeros_like(every[:, 0])
        after = {}
        for c in range(2 * cp.size - 1, min(cp.chunk_ids()) - 1, -1):
            after[c] = d
            slot = cp.gathered_slot(c)
            d = every[:, slot] + transitions[:, slot].mT @ d
        return torch.stack([after[c] for c in cp.chunk_ids()], dim=1)

    # ---- Lightning (L) -------------------------------------------------------------------

    def lightning(self, op, q, k, v, slope, *, block: int = 64) -> torch.Tensor:
        """The backend's chunked Lightning op (``op.chunked``) over this view -> o [b, s, h, dv];
        slope [h] (float64)."""
        if self.cp is None:
            return op.chunked(q, k, v, slope, block=block, resets=self.resets)[0]
        b, s, h, dv = v.shape
        n, cp = s // 2, self.cp
        resets = None if self.resets is None else _chunks(self.resets)
        o0, R = op.chunked(_chunks(q), _chunks(k), _chunks(v), slope, block=block, resets=resets)
        # transitions of all 2CP chunks, known on every rank: exp(-s n), 0 where a document starts
        M = torch.exp(-slope * n).view(1, 1, h, 1, 1).expand(b, 2 * cp.size, h, 1, 1)
        pos = torch.arange(1, n + 1, dtype=slope.dtype, device=slope.device)
        q_decay = torch.exp(-slope.view(1, 1, h) * pos.view(1, n, 1))              # [1, n, h]
        if self.full_resets is not None:
            M = M * (~self.full_resets.view(b, 2 * cp.size, n).any(-1)).view(b, -1, 1, 1, 1)
            q_decay = q_decay * (resets.long().cumsum(1) == 0).unsqueeze(-1)     # [2b, n, h]
        every = gather_reduce_scatter(R.view(b, 2, *R.shape[1:]).contiguous(), 1, cp.group)  # [b, 2CP, h, dk, dv]
        h_in = self._incoming(every, dv, M.to(R.dtype), key="lightning_state").flatten(0, 1)
        qd = _chunks(q).to(h_in.dtype) * q_decay.to(h_in.dtype).unsqueeze(-1)    # exp(-s t) q_t
        o = o0 + torch.einsum("bthk,bhkv->bthv", qd, h_in).to(o0.dtype)
        return _unchunk(o)


class StateLink:
    """The delta rule's state exchange under CP, for the ops of ``delta_rule.passing``: states
    per (local chunk, head) [z, dk, *], z = 2b·hv (chunk batches' order). ``incoming`` (autograd:
    an all-gather whose backward reduce-scatters, then the scan) serves an op that runs widened;
    ``states`` (forward) and ``gradients`` (backward) are plain and serve an op that passes the
    states itself: one all-gather each, the gathered transitions kept between them."""

    def __init__(self, view: SequenceView, b: int, hv: int, dv: int):
        self.view, self.b, self.hv, self.dv = view, b, hv, dv
        self.transitions = None                     # [b, 2CP, hv, dk, dk], rank-major, from ``states``

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.b, 2, self.hv, *x.shape[1:])             # [z, ...] -> [b, 2, hv, ...]

    def incoming(self, final: torch.Tensor) -> torch.Tensor:
        """[R | M] [z, dk, dv + dk] of the local chunks -> the states they start from [z, dk, dv]."""
        every = gather_reduce_scatter(self._local(final).contiguous(), 1, self.view.cp.group)
        return self.view._incoming(every, self.dv, key="recurrent").flatten(0, 2)

    def states(self, final: torch.Tensor) -> torch.Tensor:
        """``incoming`` without autograd; keeps every chunk's M for ``gradients``."""
        every = all_gather_tensor(self._local(final).contiguous(), 1, self.view.cp.group)
        self.transitions = every[..., self.dv:]
        return self.view._incoming(every, self.dv, key="recurrent").flatten(0, 2)

    def gradients(self, rho: torch.Tensor) -> torch.Tensor:
        """rho [z, dk, dv] (each local chunk's start-state gradient from its own outputs) -> the
        gradient of each local chunk's final state [z, dk, dv] (from the chunks after it)."""
        every = all_gather_tensor(self._local(rho).contiguous(), 1, self.view.cp.group)
        return self.view._outgoing(every, self.transitions).flatten(0, 2)


def conv_halo(x: torch.Tensor, width: int, cp, start: torch.Tensor | None = None):
    """x [b, 2n, C] (local order) -> (halo [b, 2, width, C]: for each local chunk the last ``width``
    inputs of the chunk before it in the global order, all-gathered; before chunk 0 ``start``
    [b, width, C] or zeros; last [b, width, C]: the sequence's last ``width`` inputs)."""
    b, s, c = x.shape
    n = s // 2
    if width > n:
        raise ConfigError(f"context parallelism: chunks of {n} tokens are shorter than the short convolution's "
                          f"kernel - 1 = {width}; use a longer sequence or a smaller parallel.cp")
    tails = x.reshape(b, 2, n, c)[:, :, n - width:]                                  # [b, 2, width, C]
    every = gather_reduce_scatter(tails.contiguous(), 1, cp.group)                # [b, 2CP, width, C]
    front, back = cp.chunk_ids()
    halo = every[:, [cp.gathered_slot(max(front - 1, 0)), cp.gathered_slot(back - 1)]]
    if front == 0:
        first = torch.zeros_like(halo[:, :1]) if start is None else start.to(halo.dtype).unsqueeze(1)
        halo = torch.cat([first, halo[:, 1:]], dim=1)
    return halo, every[:, cp.gathered_slot(2 * cp.size - 1)]


def masked_conv(x: torch.Tensor, weight: torch.Tensor, resets: torch.Tensor | None,
                state: torch.Tensor | None = None, state_resets: torch.Tensor | None = None) -> torch.Tensor:
    """silu(causal depthwise conv) where a token reads no input from before the start of its
    document. x [b, t, C], weight [C, K], resets [b, t] bool or None, state [b, K-1, C] (the inputs
    before x) with their own document starts ``state_resets`` [b, K-1] -> [b, t, C]. Plain
    autograd: K shifted multiply-adds."""
    b, t, c = x.shape
    kernel = weight.size(-1)
    if state is None:
        state = x.new_zeros(b, kernel - 1, c)
    full = torch.cat([state.to(x.dtype), x], dim=1)                               # [b, K-1+t, C]
    starts = torch.zeros(b, kernel - 1 + t, dtype=torch.long, device=x.device)
    if resets is not None:
        starts[:, kernel - 1:] = resets.long()
    if state_resets is not None:
        starts[:, :kernel - 1] = state_resets.long()
    cnt = starts.cumsum(1)                                                        # document starts so far
    here = cnt[:, kernel - 1:]
    pre = x * weight[:, kernel - 1]
    for shift in range(1, kernel):  # tap K-1-shift reads the input ``shift`` tokens back
        back = full[:, kernel - 1 - shift:kernel - 1 - shift + t]
        same = (cnt[:, kernel - 1 - shift:kernel - 1 - shift + t] == here).unsqueeze(-1)
        pre = pre + back * same.to(x.dtype) * weight[:, kernel - 1 - shift]
    return F.silu(pre)
