"""Linear attention (G, K, L) over a sequence that is not all in one piece: context parallelism
by state passing, packed documents by state resets.

Context parallelism (``megamoe.parallel.context``): rank r holds chunks r and 2·CP-1-r of n tokens
each. Per chunk c the recurrence is affine in the state the chunk starts from::

    H_out = M_c H_in + R_c          M_c [hv, dk, dk], R_c [hv, dk, dv]

and for every token t of the chunk o_t = o_t(0) + H_in^T (M_t^T q_t), M_t the map from the chunk
start to t. Delta rule (G, K): one run of the backend's chunked op per rank, both local chunks as
a batch of 2b sequences, with values [v | 0] and initial state [0 | I] gives everything at once:
its outputs are [o(0) | M_t^T q_t] and its final state [R_c | M_c]. Lightning (L): M_c is the
scalar exp(-s n) (times 0 when a document starts in the chunk); the op's final state is R_c.
One all-gather (backward: reduce-scatter, which carries the state gradients back to the ranks
that made them) of every rank's (M, R) pairs, a scan over the 2·CP chunks in global order
(H_0 = 0, or the decode cache's state), and the exact correction o_t = o_t(0) + (M_t^T q_t) H_in.
Bytes each rank receives per layer: 2·CP·b·hv·dk·(dk+dv)·4 (G, K; L: 2·CP·b·h·dk·dv·4), whatever
the sequence length.

Activation memory and time (G, K): the widened run shares the op's [C, C] work (the chunk
matrices, the triangular solve) between the value and the transition, and its hand-written
backward keeps what the op keeps for normal widths plus the wider U and states; a CP=2 rank
keeps about 0.55 of what one process keeps for the layer. With ``train.recompute=[core]`` the
run is checkpointed (non-reentrant ``torch.utils.checkpoint``): forward keeps only its inputs
(the chunk batches of q, k, v, g, beta) and backward runs it again, so a CP=2 rank keeps
0.2-0.3 of the layer's single-process activations for one more forward of the widened op.
Measured at 16K tokens (tools/bench_cp.py, docs/performance.md): kept, ``GdGdGdGd`` takes 0.67
of one process's CPU time per CP=2 rank and saves 0.54 of its activations; recomputed, 0.77
and 0.32. Kept besides: M_t^T q_t [2b, hv, n, dk] and the incoming states for the
correction, and the small (M, R) pairs. Two alternatives were slower on CPU: (a) a value run
plus a separate transition run of normal widths, (b) a no-grad pre-pass for (R, M) and the
real op from its true initial state: both repeat the op's per-chunk [C, C] work, which the
widened run shares and which dominates at small head dims. The short
convolution's [halo | chunk] input is recomputed too (the chunk is a view of the projection),
so no concatenated copy of the layer's inputs is kept. Neither recomputed run holds a
collective (the all-gathers stay outside), so backward exchanges nothing more. Lightning needs no widening (no
checkpoint): its op runs at normal width and only exp(-s t) q_t is kept for the correction.

Short convolution: every local chunk continues from the last ``kernel - 1`` pre-conv inputs of
the chunk before it (zeros for chunk 0): a second small all-gather, 2·CP·b·(kernel-1)·C values.
The conv role runs [halo | chunk] from a zero state and the halo's outputs are dropped
(recomputed in backward, see above).

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
from torch.utils.checkpoint import checkpoint

from megamoe.core.errors import ConfigError
from megamoe.parallel.comm import gather_reduce_scatter
from megamoe.layers.spec import ForwardInfo

RESET_LOG_DECAY = -200.0  # a document start: the state before it is multiplied by exp(-200)


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """[b, 2n, ...] (local order) -> [2b, n, ...] (one row per local chunk)."""
    return x.reshape(x.size(0) * 2, x.size(1) // 2, *x.shape[2:])


def _unchunk(x: torch.Tensor) -> torch.Tensor:
    """[2b, n, ...] -> [b, 2n, ...]."""
    return x.reshape(x.size(0) // 2, x.size(1) * 2, *x.shape[2:])


def _recomputed(fn, *args):
    """fn(*args), keeping only its tensor inputs for backward and running it again there
    (non-reentrant checkpoint) while autograd records; plain otherwise (prefill)."""
    if torch.is_grad_enabled():  # fn draws no random numbers: no RNG state to stash and restore
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def _halo_conv(conv, halo, x, weight):
    """The short-conv role over [halo | chunk] from a zero state, the halo's outputs dropped:
    halo [2b, K-1, C], x [2b, n, C] (a view of the projection: kept without a copy)."""
    return conv(torch.cat([halo, x], dim=1), weight)[0][:, weight.size(-1) - 1:]


def _widened_run(op, q, k, v, g, beta, scale, chunk_size: int):
    """The backend's chunked delta rule over chunk batches with values [v | 0] and initial state
    [0 | I] -> (o_ext [2b, n, hv, dv + dk] = [o(0) | M_t^T q_t], final [2b, hv, dk, dv + dk] =
    [R_c | M_c]). Run under a checkpoint, so the op's own recompute option is not used."""
    b2, n, hv, dv = v.shape
    dk = q.size(-1)
    v_ext = torch.cat([v, v.new_zeros(b2, n, hv, dk)], dim=-1)
    eye = torch.eye(dk, dtype=torch.float32, device=v.device)
    h0 = F.pad(eye, (dv, 0)).expand(b2, hv, dk, dv + dk).contiguous()              # [0 | I] (kernels want it dense)
    return op.chunked(q, k, v_ext, g, beta, scale=scale, initial_state=h0, chunk_size=chunk_size)


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
        if self.resets is None:  # [halo | chunk] from a zero state, halo outputs dropped: the role's
            return _unchunk(_recomputed(_halo_conv, conv, halo, _chunks(x), weight))  # training form
        n, width = x.size(1) // 2, kernel - 1                     # the halo's own document starts
        before = F.pad(self.full_resets, (width, 0))               # [b, K-1 + S]
        halo_resets = torch.stack([before[:, c * n:c * n + width] for c in self.cp.chunk_ids()], 1)
        return _unchunk(masked_conv(_chunks(x), weight, _chunks(self.resets), halo, halo_resets.flatten(0, 1)))

    # ---- delta rule (G, K) ---------------------------------------------------------------

    def delta_rule(self, op, q, k, v, g, beta, *, scale=None, chunk_size: int = 64, recompute: bool = False):
        """The backend's chunked delta rule (``op.chunked``) over this view -> o [b, s, hv, dv].
        Shapes as in ``delta_rule.py``; g [b, s, hv] or [b, s, hv, dk]. ``recompute``
        (``train.recompute=[core]``): without CP the op's own checkpoint; under CP the widened run
        keeps only its inputs and runs again in backward."""
        if self.resets is not None:
            r = self.resets.view(*self.resets.shape, *([1] * (g.dim() - 2)))
            g = torch.where(r, torch.full((), RESET_LOG_DECAY, dtype=g.dtype, device=g.device), g)
        if self.cp is None:
            return op.chunked(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, recompute=recompute)[0]
        b, s, hv, dv = v.shape
        dk = q.size(-1)
        chunked = (_chunks(t) for t in (q, k, v, g, beta))
        # recompute: the widened run keeps only its inputs and runs again in backward (module docstring)
        run = _recomputed if recompute else lambda fn, *a: fn(*a)
        o_ext, final = run(_widened_run, op, *chunked, scale, chunk_size)
        h_in = self._incoming(final.view(b, 2, hv, dk, dv + dk), dv, key="recurrent").flatten(0, 1)
        o0, qm = o_ext.split([dv, dk], dim=-1)                                    # o(0), M_t^T q_t
        qm = qm.to(h_in.dtype).transpose(1, 2).contiguous()                       # [2b, hv, n, dk], kept
        o = o0 + (qm @ h_in).transpose(1, 2).to(o0.dtype)                         # + (M_t^T q_t) H_in
        return _unchunk(o)

    def _incoming(self, local: torch.Tensor, dv: int, transitions: torch.Tensor | None = None, *,
                  key: str) -> torch.Tensor:
        """The state each local chunk starts from, [b, 2, h, dk, dv]. ``local`` [b, 2, h, dk, dv (+ dk)]:
        each local chunk's R_c (and M_c after it, unless ``transitions`` [b, 2CP, h, 1, 1] gives
        every chunk's scalar M_c in global order). One all-gather; the scan runs on every rank,
        from the decode state ``self.state[key]`` if any (then it is left as after the sequence)."""
        cp = self.cp
        every = gather_reduce_scatter(local.contiguous(), 1, cp.group)           # [b, 2CP, ...] rank-major
        h = None if self.state is None else self.state.get(key)
        h = local.new_zeros(*local.shape[:1], *local.shape[2:-1], dv) if h is None else h.to(local.dtype)
        starts = []
        for c in range(2 * cp.size if self.state is not None else max(cp.chunk_ids()) + 1):
            starts.append(h)
            R, M = every[:, cp.gathered_slot(c)].split([dv, local.size(-1) - dv], dim=-1)
            h = (transitions[:, c] * h if transitions is not None else M @ h) + R
        if self.state is not None:
            self.state[key] = h
        return torch.stack([starts[c] for c in cp.chunk_ids()], dim=1)

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
        h_in = self._incoming(R.view(b, 2, *R.shape[1:]), dv, M.to(R.dtype), key="lightning_state").flatten(0, 1)
        qd = _chunks(q).to(h_in.dtype) * q_decay.to(h_in.dtype).unsqueeze(-1)    # exp(-s t) q_t
        o = o0 + torch.einsum("bthk,bhkv->bthv", qd, h_in).to(o0.dtype)
        return _unchunk(o)


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
