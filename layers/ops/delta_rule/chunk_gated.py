"""The chunked gated delta rule with one decay per head (Gated DeltaNet), as one autograd op
with a hand-written backward that keeps its inputs, the chunk-start states, ``T``, ``W``,
``U0`` and ``U`` and recomputes the rest (autograd through the chunked form kept ~8x more).

Shapes inside: chunks flattened over (batch, head, chunk); value heads share key heads::

    q, k  [Nk, C, dk]   Nk = b * hk * n   (q already scaled)
    v     [N, C, dv]    N = b * hv * n, hv = hk * rep: value head j reads key head j // rep
    g, beta [N, C];  h0 [b * hv, dk, dv]

Per chunk, from its start state S (G: cumulative log decay from the chunk start, Gam = exp(G),
D_ij = exp(G_i - G_j) for j <= i; chunk_delta.py derives the WY form)::

    A = beta_i (k k^T)_ij D_ij (strictly lower)     M = (q k^T)_ij D_ij (lower)    T = (I + A)^-1
    W = T (beta Gam k),  U0 = T (beta v)             Kt_j = k_j exp(G_C - G_j)
    U = U0 - W S;   S' = Gam_C S + Kt^T U            (the only sequential step: two [C, d] products)
    o = (q Gam) S + M U

k k^T and q k^T are computed once per key head and shared by its value heads.

Subnormal floats: on CPU every arithmetic operation that reads or makes a subnormal takes a
micro-code assist (~100x slower), and strong decays (Qwen3-Next initialises per-head rates
up to 16, i.e. about -20 per token) push most of D, T and W into that range: the op then ran
3-6x slower. Every product here is a chain of decays between positions times O(1) numbers,
so the op drops, as exact zeros, the decays below exp(UNDERFLOW) = exp(-29), and solves for
T without decays (``decayed_inverse``: each term of T_ij carries the same factor D_ij, applied
once afterwards): no product it forms has more than two kept factors, so none gets near
exp(-87), the smallest normal float (the remaining 29 nats are margin for the O(1) factors
beside them). Each dropped term is below exp(-29) ~ 3e-13 times its O(1) factors. The gradient
of a log decay is a sum of off-diagonal terms only (d exp(G_i - G_i) / dG = 0), so for a
head decaying by -20 per token it is itself ~1e-9 and a tighter cut (exp(-20) was tried)
shows in it at 4e-5; at exp(-29) it matches a float64 recurrence to 1e-6.
(GPU kernels flush subnormals.)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megamoe.layers.ops.fusion import fused

# log decays below this are exact zeros: two kept factors multiply to >= exp(-58), far above FLT_MIN
UNDERFLOW = -29.0


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for log decays x <= 0, exactly zero below exp(UNDERFLOW). (exp of -inf, or with a
    subnormal result, takes torch's slow path on CPU: clamp first, then mask by multiplying.)"""
    return x.clamp(min=UNDERFLOW).exp_().mul_(x >= UNDERFLOW)


def decayed_inverse(B: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """T = (I + B o D)^-1 for B [N, C, C] (only its strictly lower part is read) and the decay
    matrix D (lower, unit diagonal, exactly zero where cut) -> [N, C, C], zero where D is.

    Every term of T_ij is a product along a path j < k1 < ... < i whose decays telescope to
    D_ij, so T = (I + B)^-1 o D exactly, term by term: the triangular solve runs on O(1)
    numbers (no decays, no subnormals) and the one multiply by D applies the cut."""
    eye = torch.eye(B.size(-1), dtype=B.dtype, device=B.device).expand(B.shape)
    return torch.linalg.solve_triangular(B, eye, upper=False, unitriangular=True).mul_(D)


class Heads:
    """Value heads sharing key heads: chunks ordered (batch, key head, value head, chunk)."""

    def __init__(self, rep: int, n: int):
        self.rep, self.n = rep, n                                      # value heads per key head, chunks per sequence

    @classmethod
    def of(cls, q: torch.Tensor, v: torch.Tensor, z: int) -> "Heads":
        """From q [Nk, ...], v [N, ...] and the number of (batch, value head) sequences z."""
        return cls(v.size(0) // q.size(0), v.size(0) // z)

    def per_value(self, x: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
        """A per-key-head [Nk, ...] tensor for every value head [N, ...], times ``factor`` [N, ...]."""
        Nk = x.size(0)
        xv = x.view(Nk // self.n, 1, self.n, *x.shape[1:])
        if factor is None:
            return xv.expand(-1, self.rep, -1, *x.shape[1:]).reshape(-1, *x.shape[1:])
        return (xv * factor.view(Nk // self.n, self.rep, self.n, *factor.shape[1:])).reshape(-1, *x.shape[1:])

    def dot_per_value(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """sum over the last dim of x [N, ..., d] times ``per_value(y)`` for y [Nk, ..., d],
        without materialising the expanded y -> [N, ...]."""
        Nk = y.size(0)
        xv = x.view(Nk // self.n, self.rep, self.n, *x.shape[1:])
        return torch.linalg.vecdot(xv, y.view(Nk // self.n, 1, self.n, *y.shape[1:])).view(x.shape[:-1])

    def per_key(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the value heads of each key head: [N, ...] -> [Nk, ...]."""
        if self.rep == 1:
            return x
        return x.view(-1, self.rep, self.n, *x.shape[1:]).sum(1).view(-1, *x.shape[1:])


def cumulative(g: torch.Tensor) -> torch.Tensor:
    """G = cumsum(g) over the last dim, in float64 (its differences go back to g's dtype).

    In fp32, G_i is rounded to about eps |G_i|, and |G| reaches ~600 within a chunk at
    Qwen3-Next's decay rates; exp(G_i - G_j) turns that absolute error into a relative one of
    ~4e-5 even between neighbours, and every gradient through the decays (A_log, dt_bias) with
    it. Differences of float64 sums are exact to fp32 rounding; the sums are [N, C]."""
    return g.to(torch.float64).cumsum(-1)


def decays(g: torch.Tensor):
    """g [N, C] -> (Gam = exp(G), exp(G_C - G)) [N, C] each, G the cumulative log decay."""
    G = cumulative(g)
    return decay_exp(G.to(g.dtype)), decay_exp((G[:, -1:] - G).to(g.dtype))


class Intra:
    """What a chunk needs that does not depend on its start state (the forward's, kept for the
    backward). No concatenations: one product per piece, masks as 0/1 factors (torch's
    masked_fill and where took ~5x a multiply on CPU)."""

    def __init__(self, q, k, v, g, beta, heads: Heads):
        G = cumulative(g)                                              # [N, C], float64
        diff = (G.unsqueeze(-1) - G.unsqueeze(-2)).to(g.dtype)         # [N, C, C]: G_i - G_j
        # D = exp(G_i - G_j) on and below the diagonal, exactly 0 below exp(UNDERFLOW) (clamped
        # first: an exp with a subnormal result is slow) and above the diagonal
        self.D = F.threshold_(diff.clamp_(UNDERFLOW - 1, 0.0).exp_(), math.exp(UNDERFLOW), 0.0).tril_()
        KK, QK = k @ k.mT, q @ k.mT                                    # [Nk, C, C], per key head
        # for the backward: A = beta KD below the diagonal (intra_grads drops the rest), M = QK D;
        # every gradient through them is multiplied by D, so none needs masking
        self.KD, self.M = heads.per_value(KK, self.D), heads.per_value(QK, self.D)
        self.gam, self.tail = decays(g)
        self.Kt = heads.per_value(k, self.tail.unsqueeze(-1))          # k_j exp(G_C - G_j)
        self.T = decayed_inverse(heads.per_value(KK, beta.unsqueeze(-1)), self.D)
        Kb = heads.per_value(k, (beta * self.gam).unsqueeze(-1))       # beta Gam k [N, C, dk]
        self.W, self.U0 = self.T @ Kb, self.T @ (v * beta.unsqueeze(-1))  # [N, C, dk], [N, C, dv]


def scan_chunks(W: torch.Tensor, U0: torch.Tensor, Kt: torch.Tensor, decay: torch.Tensor, h0: torch.Tensor):
    """The sequential step, chunk by chunk from S_0 = h0 [z, dk, dv]::

        U_i = U0_i - W_i S_i,    S_{i+1} = Gam_C,i S_i + Kt_i^T U_i

    W, Kt [N = z n, C, dk], U0 [N, C, dv], decay Gam_C [z n] -> (chunk-start states S
    [N, dk, dv], U [N, C, dv], both in chunk order, and the final state [z, dk, dv]). Two
    [C, d] products per step instead of the [dk, dk] transition P = Gam_C I - Kt^T W: forming
    P and Kt^T U0 for every chunk and U afterwards cost more than the step saved."""
    z = h0.size(0)
    n = W.size(0) // z
    Wz, U0z, Ktz, gz = W.unflatten(0, (z, n)), U0.unflatten(0, (z, n)), Kt.unflatten(0, (z, n)), decay.view(z, n, 1, 1)
    states = h0.new_empty((n + 1, *h0.shape))                         # scan order: each step one block
    Us = U0.new_empty((n, z, *U0.shape[1:]))
    states[0] = h0
    for i in range(n):
        torch.baddbmm(U0z[:, i], Wz[:, i], states[i], alpha=-1, out=Us[i])
        torch.baddbmm(states[i] * gz[:, i], Ktz[:, i].mT, Us[i], out=states[i + 1])
    return chunk_major(states[:-1]), chunk_major(Us), states[-1]


def scan_chunks_backward(W, Kt, decay, X, Y, dfinal, z: int):
    """The reverse of ``scan_chunks``, from d(final state) ``dfinal`` (None: zero)::

        dU_i = Y_i + Kt_i dS_{i+1},    dS_i = X_i + Gam_C,i dS_{i+1} - W_i^T dU_i

    with X = (q Gam)^T dO [N, dk, dv] and Y = M^T dO [N, C, dv], the parts that do not
    depend on later chunks -> (dS of the chunk-end states [N, dk, dv], dU [N, C, dv] in chunk
    order, dS_0 [z, dk, dv])."""
    n = W.size(0) // z
    Wz, Ktz, gz = W.unflatten(0, (z, n)), Kt.unflatten(0, (z, n)), decay.view(z, n, 1, 1)
    Xz, Yz = X.unflatten(0, (z, n)), Y.unflatten(0, (z, n))
    dS = X.new_empty((n + 1, z, *X.shape[1:]))                        # [n + 1, z, dk, dv]
    dUs = Y.new_empty((n, z, *Y.shape[1:]))
    dS[-1] = 0 if dfinal is None else dfinal
    for i in range(n - 1, -1, -1):
        torch.baddbmm(Yz[:, i], Ktz[:, i], dS[i + 1], out=dUs[i])
        torch.baddbmm(torch.addcmul(Xz[:, i], dS[i + 1], gz[:, i]), Wz[:, i].mT, dUs[i], alpha=-1, out=dS[i])
    return chunk_major(dS[1:]), chunk_major(dUs), dS[0]


def chunk_major(states: torch.Tensor) -> torch.Tensor:
    """[n, z, ...] (scan order) -> [z n, ...] (the order of the chunks)."""
    return states.transpose(0, 1).reshape(-1, *states.shape[2:])


def rev_cumsum(x: torch.Tensor) -> torch.Tensor:
    """y_t = sum_{s >= t} x_s over the last dim."""
    return x.flip(-1).cumsum(-1).flip(-1)


def straddling(E: torch.Tensor) -> torch.Tensor:
    """R_t = sum_{i >= t > j} E_ij for E [N, C, C] -> [N, C] (R_0 = 0): the d/dg_t of what
    depends on exp(G_i - G_j), summed directly. (Row sums minus column sums, then a reverse
    cumsum, gives the same R but adds and cancels every pair on one side of t, losing the small
    R of early positions in the rounding of the large sums.) The prefix sums over j are one
    matmul with a triangle of ones (a cumsum here took ~5% more of the op's time)."""
    C = E.size(-1)
    upto = torch.ones(C, C - 1, dtype=E.dtype, device=E.device).triu_()   # [j <= c]
    below = torch.ones(C, C - 1, dtype=E.dtype, device=E.device).tril_(-1)  # [i > c]
    # (E upto)_ic = sum_{j <= c} E_ij; R_{c+1} sums it over i > c
    return F.pad(((E @ upto) * below).sum(-2), (1, 0))


@fused
def intra_grads(dA, dM, dKb, dVb, dKt, dQg, D, KD, M, Qg, k, v, beta, gam_, tail_, dgam_end, rep: int, n: int):
    """The backward's elementwise part (one fused pass when the op runs with ``fuse``), from
    the gradients of the chunk products [N, C, C] / [N, C, d] through A = beta (k k^T) D,
    M = (q k^T) D, Kb = beta Gam k, Vb = beta v, Kt = k exp(G_C - G) and q Gam, and of the
    chunk-end decay ``dgam_end`` [N] -> (dbeta [N, C], dv [N, C, dv], dg [N, C], d(k k^T) and
    d(q k^T) [Nk, C, C] per key head, the direct parts of dk and dq [Nk, C, dk])."""
    heads = Heads(rep, n)
    dA = dA.tril(-1)                                                   # A is strictly lower
    dKb_k = heads.dot_per_value(dKb, k)                                # sum_d dKb k, per token
    dbeta = torch.linalg.vecdot(dA, KD) + dKb_k * gam_ + torch.linalg.vecdot(dVb, v)
    dA.mul_(beta.unsqueeze(-1))                                        # d(k k^T D)
    E = (dA * KD).addcmul_(dM, M)                                      # dD * D, lower
    # through exp(G_i) (Kb, q Gam, the chunk-end decay): G_i = g_0 + ... + g_i, a reverse cumsum
    dabs = dKb_k * beta * gam_ + torch.linalg.vecdot(dQg, Qg)
    dabs[:, -1] += dgam_end * gam_[:, -1]
    dg = rev_cumsum(dabs)
    # through exp(G_i - G_j) (j < i): g_t for j < t <= i, i.e. the pairs that straddle t
    dg += straddling(E)
    # through exp(G_C - G_j): g_t for t > j, an exclusive cumsum (de_C: exp(0), constant)
    de = heads.dot_per_value(dKt, k) * tail_
    dg[:, 1:] += de[:, :-1].cumsum(-1)
    dKK, dQK = heads.per_key(dA.mul_(D)), heads.per_key(dM * D)
    dk_direct = heads.per_key(dKb.mul((beta * gam_).unsqueeze(-1)).addcmul_(dKt, tail_.unsqueeze(-1)))
    dq_direct = heads.per_key(dQg * gam_.unsqueeze(-1))
    return dbeta, dVb * beta.unsqueeze(-1), dg, dKK, dQK, dk_direct, dq_direct


class ChunkGatedDelta(torch.autograd.Function):
    """(q, k, v, g, beta, h0) as in the module docstring -> (o [N, C, dv], final state [z, dk, dv]), fp32.

    Kept for the backward besides the inputs and the chunk-start states S: D, KD, M, T, W, U0, U
    (recomputing them took about a third of the backward; 3 [C, C] and 3 [C, d] per chunk,
    a fraction of what autograd kept)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, fuse):
        heads = Heads.of(q, v, h0.size(0))
        it = Intra(q, k, v, g, beta, heads)
        S, U, final = scan_chunks(it.W, it.U0, it.Kt, it.gam[:, -1], h0)   # S: chunk-start states
        o = torch.baddbmm(it.M @ U, heads.per_value(q, it.gam.unsqueeze(-1)), S)  # M U + (q Gam) S
        ctx.z, ctx.fuse = h0.size(0), fuse
        ctx.save_for_backward(q, k, v, g, beta, S, it.D, it.KD, it.M, it.T, it.W, it.U0, U)
        return o, final.clone()

    def backward(ctx, dO, dfinal):
        q, k, v, g, beta, S, D, KD, M, T, W, U0, U = saved = ctx.saved_tensors
        dO = dO.contiguous()  # arrives as a transposed view; four products read it
        z, heads = ctx.z, Heads.of(q, v, ctx.z)
        gam_, tail_, Kt, Qg = factors = Factors.of(q, k, g, heads)
        dSe, dU, dS0 = scan_chunks_backward(W, Kt, gam_[:, -1], Qg.mT @ dO, M.mT @ dO, dfinal, z)
        return (*input_grads(saved, dO, dSe, dU, heads, factors, ctx.fuse), dS0, None)


class Factors(tuple):
    """(Gam, exp(G_C - G) [N, C], Kt = k exp(G_C - G), Qg = q Gam [N, C, dk]): the backward's decayed keys and
    queries, rebuilt from q, k, g (cheaper than keeping them)."""

    @classmethod
    def of(cls, q, k, g, heads: Heads) -> "Factors":
        gam_, tail_ = decays(g)
        return cls((gam_, tail_, heads.per_value(k, tail_.unsqueeze(-1)), heads.per_value(q, gam_.unsqueeze(-1))))


def input_grads(saved, dO, dSe, dU, heads: Heads, factors: Factors, fuse: bool):
    """The backward after the scan, from what ``ChunkGatedDelta`` saves, dO [N, C, dv], the
    gradients of the chunk-end states dSe [N, dk, dv] and of U [N, C, dv] -> (dq, dk, dv, dg,
    dbeta) in the chunk layout."""
    q, k, v, g, beta, S, D, KD, M, T, W, U0, U = saved
    gam_, tail_, _, Qg = factors
    dQg = dO @ S.mT                                                # [N, C, dk]
    dM = dO @ U.mT                                                 # [N, C, C]
    dKt = U @ dSe.mT                                               # [N, C, dk]
    dgam_end = (dSe * S).sum((-1, -2))                             # d Gam_C [N]
    dW = (dU @ S.mT).neg_()
    # through W = T Kb, U0 = T Vb and T = (I + A)^-1: dT = dW Kb^T + dU Vb^T and
    # dA = -T^T dT T^T = -(T^T dW) W^T - (T^T dU) U0^T, two [C, d] x [d, C] products
    dKb, dVb = T.mT @ dW, T.mT @ dU
    dA = torch.baddbmm(dKb @ W.mT, dVb, U0.mT).neg_()
    dbeta, dv, dg, dKK, dQK, dk_direct, dq_direct = intra_grads.pick(fuse)(
        dA, dM, dKb, dVb, dKt, dQg, D, KD, M, Qg, k, v, beta, gam_, tail_, dgam_end, heads.rep, heads.n)
    dk = torch.baddbmm(torch.baddbmm(dKK @ k, dKK.mT, k), dQK.mT, q).add_(dk_direct)
    dq = torch.baddbmm(dq_direct, dQK, k)
    return dq, dk, dv, dg, dbeta


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64,
                           fuse: bool = False):
    """The op on the package's layout (delta_rule.py): q, k [b, t, hk, dk], v [b, t, hv, dv],
    g, beta [b, t, hv] -> (o [b, t, hv, dv] in v's dtype, final state [b, hv, dk, dv] fp32).
    ``fuse``: the backward's elementwise part runs compiled (``intra_grads``)."""
    b, t, hv, dv = v.shape
    dtype, dk = v.dtype, q.size(-1)
    q, k, v, g, beta, h0 = to_chunks(q, k, v, g, beta, scale, initial_state, chunk_size)
    o, final = ChunkGatedDelta.apply(q, k, v, g, beta, h0.reshape(b * hv, dk, dv), fuse)
    return from_chunks(o, b, hv, t, dtype), final.view(b, hv, dk, dv)


def to_chunks(q, k, v, g, beta, scale, initial_state, C: int):
    """The package's layout -> the op's (module docstring), padded to whole chunks of C tokens
    (zero k, v, beta and g leave the state untouched); the initial state as ``prepare`` gives it."""
    from megamoe.layers.ops.delta_rule.naive import prepare

    t = v.size(1)
    q, k, v, g, beta, h0 = prepare(q, k, v, g, beta, scale, initial_state, expand=False)  # [b, h, t, d]
    pad = -t % C
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    chunks = lambda x: x.reshape(-1, C, x.size(-1))  # noqa: E731  [b, h, n C, d] -> [b h n, C, d]
    return chunks(q), chunks(k), chunks(v), g.reshape(-1, C), beta.reshape(-1, C), h0


def from_chunks(o: torch.Tensor, b: int, hv: int, t: int, dtype: torch.dtype) -> torch.Tensor:
    """o [b hv n, C, dv] (the op's layout) -> [b, t, hv, dv] (the package's) in ``dtype``."""
    return o.view(b, hv, -1, o.size(-1))[:, :, :t].transpose(1, 2).to(dtype)
