"""The gated delta rule in chunks (training form): batched work inside chunks, a short scan across.

One decay per head (Gated DeltaNet) goes to the fused op in chunk_gated.py; this file's
autograd form serves one decay per key channel (KDA) and derives the maths both share.

Within a chunk of C tokens starting from state S (G_t: cumulative log decay from the chunk
start, per key channel; Gamma_t = exp(G_t)), the delta rule unrolls to (WY form)::

    A[i, j] = beta_i sum_d k_id k_jd exp(G_id - G_jd)        j < i     (strictly lower)
    M[i, j] =        sum_d q_id k_jd exp(G_id - G_jd)        j <= i
    T = (I + A)^-1;  W = T (beta Gamma k),  U0 = T (beta v)            (one triangular solve)
    corrections U = U0 - W S;   o = (q Gamma) S + M U
    S' = diag(Gamma_C) S + K~^T U,   K~_j = k_j exp(G_C - G_j)

Everything that does not depend on S is computed for all chunks at once, and the scan across
chunks collapses to one affine map per chunk, ``S' = P S + R`` with
``P = diag(Gamma_C) - K~^T W`` and ``R = K~^T U0``; the outputs follow from the stacked
chunk-start states as ``o = (q Gamma - M W) S + M U0``. The scan is the only sequential part:
one [dk, dk] x [dk, dv] product per chunk forward and backward (``StateScan``). ``T`` has a
matmul backward too (``UnitLowerInverse``); autograd handles the rest, which is batched.

Every exponent is the sum of g over one segment of the chunk, and each is computed as that
segment's own sum in q's dtype (``DecayOffsets``), never as a difference of two prefix sums
G_i - G_j: in fp32 G_t carries an error of about eps |G_t| (|G| reaches hundreds within a
chunk at the mixers' strongest decays), which exp(G_i - G_j) would turn into a relative error
of ~1e-5 even between neighbours, and the decay parameters' gradients with it. Each segment is
a block of the halving below (or its prefix / suffix), so all of them come from one tree of
half-block sums, forward and backward, without float64.

Exponents are never positive (decays are <= 0 and the reference point of every product is
between the two positions), so nothing overflows, whatever the decay: with per-channel decay
(KDA) the [C, C] matrices are built by halving down to single tokens, each off-diagonal
quadrant one matmul through the midpoint (``intra_per_channel``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megamoe.layers.ops.delta_rule.chunk_gated import chunk_gated_delta_rule
from megamoe.layers.ops.delta_rule.naive import prepare

class StateScan(torch.autograd.Function):
    """states[0] = h0, states[n+1] = P[n] @ states[n] + R[n].

    P [n, B, dk, dk], R [n, B, dk, dv], h0 [B, dk, dv] -> states [n+1, B, dk, dv] (fp32).
    Backward runs the transposed recurrence once: dS[n] = dstates[n] + P[n]^T dS[n+1].
    """

    @staticmethod
    def forward(ctx, P, R, h0):
        n = P.size(0)
        states = R.new_empty((n + 1, *h0.shape))
        states[0] = h0
        for i in range(n):
            torch.baddbmm(R[i], P[i], states[i], out=states[i + 1])
        ctx.save_for_backward(P, states)
        return states

    @staticmethod
    def backward(ctx, dstates):
        P, states = ctx.saved_tensors
        dS = dstates.clone()
        for i in range(P.size(0) - 1, -1, -1):
            dS[i].baddbmm_(P[i].transpose(-1, -2), dS[i + 1])
        dP = dS[1:] @ states[:-1].transpose(-1, -2)
        return dP, dS[1:], dS[0]


class UnitLowerInverse(torch.autograd.Function):
    """T = (I + A)^-1 for A strictly lower triangular (what is on and above A's diagonal is
    ignored). A [..., C, C] -> T [..., C, C]. Backward: dA = -tril(T^T dT T^T, -1).

    One triangular solve against the identity, then matmuls: solving against the wide
    right-hand side [beta k | beta v] directly, and differentiating through the solve, is
    several times slower on CPU."""

    @staticmethod
    def forward(ctx, A):
        eye = torch.eye(A.size(-1), dtype=A.dtype, device=A.device).expand(A.shape)
        T = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
        ctx.save_for_backward(T)
        return T

    @staticmethod
    def backward(ctx, dT):
        (T,) = ctx.saved_tensors
        Tt = T.transpose(-1, -2)
        return -(Tt @ dT @ Tt).tril(-1)


class DecayOffsets(torch.autograd.Function):
    """The sums of the log decays g that the op exponentiates, each to a few ulps of itself.

    g [..., C, dk] -> (head, tail, last, *levels):
      head [.., C, dk]  g from the chunk start to t (log Gamma_t)
      tail [.., C, dk]  g after t to the chunk end (G_C - G_t)
      last [.., 1, dk]  g over the whole chunk (G_C)
      levels, for half = 1, 2, 4, .., C / 2 (blocks of 2 half tokens), two each,
        rows [.., C / (2 half), half, dk]  second halves: g from the half's first token to t
        cols [.., C / (2 half), half, dk]  first halves: g after t to the half's last token

    Built bottom-up: at block size h, ``pre`` (from the block's first token to t) and ``suf``
    (after t to the block's last) for 2h follow from those for h by adding a half's total to
    the other half. Every partial sum is of one segment, all terms of one sign, so it is exact
    to a few ulps of itself; a difference of prefix sums is exact only to ulps of the longer
    prefix. The backward runs the same tree top-down: each position's gradient is the sum of
    the gradients of the sums that contain it, nothing subtracted. Work and memory are a few
    passes over g; no float64.
    """

    @staticmethod
    def forward(ctx, g):
        C = g.size(-2)
        pre = g.clone(memory_format=torch.contiguous_format)  # contiguous: the halves below are views
        suf = torch.zeros_like(pre)
        levels = []
        h = 1
        while h < C:
            P, S = (x.unflatten(-2, (C // (2 * h), 2, h)) for x in (pre, suf))  # [.., C/2h, 2, h, dk]
            levels += [P[..., 1, :, :].clone(), S[..., 0, :, :].clone()]
            S[..., 0, :, :] += P[..., 1, -1:, :]  # first half: + the second half's total
            P[..., 1, :, :] += P[..., 0, -1:, :]  # second half: + the first half's total
            h *= 2
        return pre, suf, pre[..., -1:, :].clone(), *levels

    @staticmethod
    def backward(ctx, d_head, d_tail, d_last, *d_levels):
        C = d_head.size(-2)
        dpre = d_head.clone(memory_format=torch.contiguous_format)
        dsuf = d_tail.clone(memory_format=torch.contiguous_format)
        dpre[..., -1:, :] += d_last
        h, i = C // 2, len(d_levels) - 2
        while h >= 1:
            P, S = (x.unflatten(-2, (C // (2 * h), 2, h)) for x in (dpre, dsuf))
            # the forward's two additions at this size, transposed, in reverse order
            P[..., 0, -1:, :] += P[..., 1, :, :].sum(-2, keepdim=True)
            P[..., 1, -1:, :] += S[..., 0, :, :].sum(-2, keepdim=True)
            P[..., 1, :, :] += d_levels[i]
            S[..., 0, :, :] += d_levels[i + 1]
            h, i = h // 2, i - 2
        return dpre


def intra_per_channel(q, k, beta, levels):
    """A (strictly lower part used) and M for one decay per key channel, by halving.
    q, k [..., C, dk]; beta [..., C]; levels: ``DecayOffsets``' -> [..., C, C] each.

    Every block of B tokens is [[top, 0], [quad, bottom]]: ``quad`` (rows in the second half,
    columns in the first) factors through the last position r of the first half,
    exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both exponents <= 0 (the level's rows and
    cols sums), so it is one matmul; ``top`` and ``bottom`` are the blocks of the level below,
    down to single tokens (no decay: the diagonal, sum_d rows_id k_id).
    """
    *lead, C, dk = q.shape
    rows = torch.stack([k * beta.unsqueeze(-1), q])                    # [2, .., C, dk]: A rows, M rows
    blocks = lambda x, n: x.reshape(*x.shape[:-2], n, C // n, x.size(-1))  # noqa: E731
    D = (rows * k).sum(-1)[..., None, None]                            # [2, .., C, 1, 1]
    size = 2
    for rows_off, cols_off in zip(levels[::2], levels[1::2]):
        n, half = C // size, size // 2
        k_b, rows_b = blocks(k, n), blocks(rows, n)
        rows_r = rows_b[..., half:, :] * rows_off.exp()                  # [2, .., n, half, dk]
        cols_r = k_b[..., :half, :] * cols_off.exp()                     # [.., n, half, dk]
        quad = rows_r @ cols_r.transpose(-1, -2)                          # [2, .., n, half, half]
        D = D.reshape(*D.shape[:-3], n, 2, half, half)
        top = torch.cat([D[..., 0, :, :], torch.zeros_like(quad)], dim=-1)
        D = torch.cat([top, torch.cat([quad, D[..., 1, :, :]], dim=-1)], dim=-2)  # [2, .., n, size, size]
        size *= 2
    A, M = D.reshape(2, *lead, C, C)
    return A, M


def chunk_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                     recompute: bool = False, fuse: bool = False):
    """Chunked gated delta rule; same arguments, results and shapes as ``naive_delta_rule``.

    ``recompute``: keep only the inputs for the backward and rebuild the chunk matrices there
    (as fla does): the intermediates are ~8x the inputs (expanded key heads, [C, C] matrices,
    chunk states), the recomputation costs one forward of the op. The per-head op
    (chunk_gated.py) always works that way and needs no checkpoint around it. ``fuse``: the
    per-head op's backward runs its fused kernel (``megamoe.layers.ops.fusion``)."""
    if g.dim() == 3:
        recompute = False
    if recompute and torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
        return checkpoint(_chunk_delta_rule, q, k, v, g, beta, scale, initial_state, chunk_size, fuse,
                          use_reentrant=False)
    return _chunk_delta_rule(q, k, v, g, beta, scale, initial_state, chunk_size, fuse)


def _chunk_delta_rule(q, k, v, g, beta, scale, initial_state, chunk_size, fuse=False):
    C = chunk_size
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size={C} must be a power of two")
    if g.dim() == 3:  # one decay per head (Gated DeltaNet): the fused op
        return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, C, fuse)
    dtype = v.dtype
    b, t, hv, dv = v.shape
    q, k, v, g, beta, h0 = prepare(q, k, v, g, beta, scale, initial_state)
    dk = q.size(-1)
    pad = -t % C
    if pad:  # zero k, v, beta and g leave the state untouched
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (t + pad) // C
    q, k, v, g = (x.reshape(b, hv, n, C, x.size(-1)) for x in (q, k, v, g))
    beta = beta.reshape(b, hv, n, C)
    head, tail, G_last, *levels = DecayOffsets.apply(g)  # sums of g: see the module docstring
    A, M = intra_per_channel(q, k, beta, levels)

    gamma = head.exp()
    k_tail = k * tail.exp()                                         # decayed to the chunk end
    T = UnitLowerInverse.apply(A)
    # W | U0 side by side: fewer, wider matmuls
    WU = T @ torch.cat([k * (gamma * beta.unsqueeze(-1)), v * beta.unsqueeze(-1)], -1)  # [.., C, dk+dv]
    KW, R = (k_tail.transpose(-1, -2) @ WU).split([dk, dv], -1)      # [b, h, n, dk, dk | dv]
    P = torch.diag_embed(G_last.squeeze(-2).exp().expand(b, hv, n, dk)) - KW
    MW, o_local = (M @ WU).split([dk, dv], -1)
    q_state = q * gamma - MW                                        # reads the chunk-start state

    # scan over chunks with (b*h) as the batch: [n, b*h, ...]
    to_scan = lambda x: x.reshape(b * hv, n, *x.shape[-2:]).transpose(0, 1)  # noqa: E731
    states = StateScan.apply(to_scan(P), to_scan(R), h0.reshape(b * hv, dk, dv))
    starts = states[:-1].transpose(0, 1).reshape(b, hv, n, dk, dv)
    o = q_state @ starts + o_local                                  # [b, h, n, C, dv]
    o = o.reshape(b, hv, n * C, dv)[:, :, :t].transpose(1, 2)
    return o.to(dtype), states[-1].reshape(b, hv, dk, dv)
