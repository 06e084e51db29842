"""The gated delta rule in chunks (training form): batched work inside chunks, a short scan across.

Within a chunk of C tokens starting from state S (G_t: cumulative log decay from the chunk
start, per key channel; Gamma_t = exp(G_t)), the delta rule unrolls to (WY form)::

    A[i, j] = beta_i sum_d k_id k_jd exp(G_id - G_jd)        j < i     (strictly lower)
    M[i, j] =        sum_d q_id k_jd exp(G_id - G_jd)        j <= i
    (I + A) [W | U0] = [beta Gamma k | beta v]                         (one triangular solve)
    corrections U = U0 - W S;   o = (q Gamma) S + M U
    S' = diag(Gamma_C) S + K~^T U,   K~_j = k_j exp(G_C - G_j)

Everything that does not depend on S is computed for all chunks at once, and the scan across
chunks collapses to one affine map per chunk, ``S' = P S + R`` with
``P = diag(Gamma_C) - K~^T W`` and ``R = K~^T U0``; the outputs follow from the stacked
chunk-start states as ``o = (q Gamma - M W) S + M U0``. The scan is the only sequential part:
one [dk, dk] x [dk, dv] product per chunk forward and backward (``StateScan``). Autograd
handles the rest, which is batched.

Exponents are never positive (decays are <= 0 and the reference point of every product is
between the two positions), so nothing overflows: per-channel decay (KDA) is split into
sub-blocks of ``SUB`` tokens whose off-diagonal products factor through the sub-block start,
and whose diagonal blocks are computed elementwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.layers.linear_attention.delta_rule import prepare

SUB = 16  # sub-block for per-channel decay inside a chunk


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


def intra_per_head(q, k, beta, G):
    """A and M for one decay per head. q, k [..., C, dk]; beta [..., C]; G [..., C, 1]."""
    C = q.size(-2)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (G - G.transpose(-1, -2)).masked_fill(upper, float("-inf")).exp()  # [.., C, C]
    kk_qk = torch.cat([k * beta.unsqueeze(-1), q], dim=-2) @ k.transpose(-1, -2)  # [.., 2C, C]
    A, M = (kk_qk.unflatten(-2, (2, C)) * decay.unsqueeze(-3)).unbind(-3)
    return A.tril(-1), M


def intra_per_channel(q, k, beta, G, sub: int = SUB):
    """A and M for one decay per key channel. q, k, G [..., C, dk]; beta [..., C].

    Rows of sub-block I meet columns before it through the sub-block start s_I:
    exp(G_i - G_j) = exp(G_i - G_s) exp(G_s - G_j), both factors <= 1. Columns inside the
    sub-block (the diagonal blocks) are computed elementwise, [sub, sub, dk] per block.
    """
    *lead, C, dk = q.shape
    nb = C // sub
    blocks = lambda x: x.reshape(*lead, nb, sub, x.size(-1))  # noqa: E731
    Gb = blocks(G)
    ref = Gb[..., :1, :]                                          # [.., nb, 1, dk] sub-block starts
    rows = torch.stack([blocks(k * beta.unsqueeze(-1)), blocks(q)])  # [2, .., nb, sub, dk]
    rows_scaled = rows * (Gb - ref).exp()
    # columns j < s_I decayed to s_I: [.., nb, C, dk]; later columns get -inf, i.e. zero
    later = torch.arange(C, device=q.device) >= (torch.arange(nb, device=q.device) * sub).unsqueeze(-1)
    expo = (ref - G.unsqueeze(-3)).masked_fill(later.unsqueeze(-1), float("-inf"))
    cols = k.unsqueeze(-3) * expo.exp()
    off = rows_scaled @ cols.transpose(-1, -2)                     # [2, .., nb, sub, C]
    # diagonal blocks, elementwise: [.., nb, sub, sub, dk]
    upper = torch.ones(sub, sub, dtype=torch.bool, device=q.device).triu(1)
    pair = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(upper.unsqueeze(-1), float("-inf")).exp()
    diag = (rows.unsqueeze(-2) * (blocks(k).unsqueeze(-3) * pair)).sum(-1)  # [2, .., nb, sub, sub]
    both = off.reshape(2, *lead, nb, sub, nb, sub)
    both.diagonal(dim1=-4, dim2=-2).add_(diag.movedim(-3, -1))   # the (I, I) blocks
    A, M = both.reshape(2, *lead, C, C)
    return A.tril(-1), M


def chunk_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64):
    """Chunked gated delta rule; same arguments, results and shapes as ``naive_delta_rule``."""
    dtype = v.dtype
    b, t, hv, dv = v.shape
    q, k, v, g, beta, h0 = prepare(q, k, v, g, beta, scale, initial_state)
    dk = q.size(-1)
    per_channel = g.size(-1) > 1
    C = chunk_size
    if per_channel and C % SUB:
        raise ValueError(f"chunk_size={C} must be a multiple of {SUB} for per-channel decay")
    pad = -t % C
    if pad:  # zero k, v, beta and g leave the state untouched
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (t + pad) // C
    q, k, v, g = (x.reshape(b, hv, n, C, x.size(-1)) for x in (q, k, v, g))
    beta = beta.reshape(b, hv, n, C)
    G = g.cumsum(-2)
    A, M = intra_per_channel(q, k, beta, G) if per_channel else intra_per_head(q, k, beta, G)

    gamma = G.exp()
    G_last = G[..., -1:, :]
    k_tail = k * (G_last - G).exp()                                 # decayed to the chunk end
    rhs = torch.cat([k * (gamma * beta.unsqueeze(-1)), v * beta.unsqueeze(-1)], dim=-1)
    WU = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    W, U0 = WU.split([dk, dv], dim=-1)
    kT = k_tail.transpose(-1, -2)
    P = torch.diag_embed(G_last.squeeze(-2).exp().expand(b, hv, n, dk)) - kT @ W   # [b, h, n, dk, dk]
    R = kT @ U0                                                                   # [b, h, n, dk, dv]
    q_state = q * gamma - M @ W                                     # reads the chunk-start state
    o_local = M @ U0

    # scan over chunks with (b*h) as the batch: [n, b*h, ...]
    to_scan = lambda x: x.reshape(b * hv, n, *x.shape[-2:]).transpose(0, 1)  # noqa: E731
    states = StateScan.apply(to_scan(P), to_scan(R), h0.reshape(b * hv, dk, dv))
    starts = states[:-1].transpose(0, 1).reshape(b, hv, n, dk, dv)
    o = q_state @ starts + o_local                                  # [b, h, n, C, dv]
    o = o.reshape(b, hv, n * C, dv)[:, :, :t].transpose(1, 2)
    return o.to(dtype), states[-1].reshape(b, hv, dk, dv)
