"""The delta rule over the local chunks of a context-parallel sequence, with the state passed
between chunks (ranks) through a ``link`` (``megamoe.layers.ops.sequence_view.StateLink``).

Within a chunk the recurrence is affine in the state H_in the chunk starts from; so is every
chunk-start state S_i of the op's inner chunks (C tokens each), and, in backward, every state
gradient is affine in the gradient dH_out of the chunk's final state::

    S_i  = S_i(0)  + Pi_i H_in          S_n = R + M H_in   (M = Pi_n: the chunk's transition)
    dS_i = dS_i(0) + Phi_i dH_out       dH_in = rho + M^T dH_out   (rho = dS_0(0))

Two forms:

- ``ChunkGatedDeltaPassing`` (one decay per head, G): fla's ``fla/ops/cp`` design on the CPU op
  (chunk_gated.py). The chunk's [C, C] work (``Intra``: decays, T, W, U0, M) runs once at the
  value's width. Forward: one scan of the states [S(0) | Pi] (width dv + dk: from [0 | I], the
  transition columns fed no values) gives R and M; the link exchanges them and returns H_in; the
  true chunk-start states follow in one batched product, S = S(0) + Pi H_in, and the outputs
  from them at width dv, as the op gives them without CP. Backward: one reverse scan of
  [dS(0) | Phi] (width dv + dk, from [0 | I]) gives rho; the link exchanges it and returns
  dH_out (from the later chunks' rho and M); dS = dS(0) + Phi dH_out, and the op's own backward
  finishes (``input_grads``) at width dv. No autograd through the exchange: the op calls the
  link's collectives itself, forward and backward. ``recompute``: keeps only its inputs and
  H_in; backward rebuilds ``Intra`` and scans from H_in at width dv.
- ``widened_passing`` (any backend's chunked op: KDA's per-channel form, the reference
  recurrence, fla's kernels): the op run once with values [v | 0] from the initial state
  [0 | I] gives [o(0) | M_t^T q_t] and the final state [R | M]; the link's autograd exchange
  (all-gather, reduce-scatter in backward) and scan give H_in, and o = o(0) + (M_t^T q_t) H_in.
  Its backward runs the widened op's backward (every [C, d] product at width dv + dk).

Shapes: chunk batches [2b, n, ...] (row 2i + j: row i's local chunk j, ``sequence_view``); the
link takes and returns per-(chunk, head) states [z, dk, *], z = 2b * hv.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megamoe.layers.ops.delta_rule.chunk_gated import (Factors, Heads, Intra, from_chunks, input_grads, scan_chunks,
                                                       to_chunks)


def _recomputed(fn, *args):
    """fn(*args), keeping only its tensor inputs for backward and running it again there
    (non-reentrant checkpoint) while autograd records; plain otherwise (prefill)."""
    if torch.is_grad_enabled():  # fn draws no random numbers: no RNG state to stash and restore
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def _identity_columns(z: int, dk: int, dv: int, like: torch.Tensor) -> torch.Tensor:
    """[0 | I] [z, dk, dv + dk]: a state whose last dk columns carry the transition."""
    h0 = like.new_zeros(z, dk, dv + dk)
    h0[:, :, dv:] = torch.eye(dk, dtype=like.dtype, device=like.device)
    return h0


def transition_scan(W, U0, Kt, decay, z: int) -> torch.Tensor:
    """``scan_chunks`` from [0 | I] with values [U0 | 0]: W, Kt [N, C, dk], U0 [N, C, dv], decay
    [N] -> the states [S(0) | Pi] [n + 1, z, dk, dv + dk] in scan order (the last: [R | M])."""
    n, dk, dv = W.size(0) // z, W.size(-1), U0.size(-1)
    Wz, Ktz, gz = W.unflatten(0, (z, n)), Kt.unflatten(0, (z, n)), decay.view(z, n, 1, 1)
    U0z = F.pad(U0, (0, dk)).unflatten(0, (z, n))
    states = W.new_empty((n + 1, z, dk, dv + dk))
    states[0] = _identity_columns(z, dk, dv, W)
    U = U0z.new_empty((z, *U0z.shape[2:]))                             # one step's, reused
    for i in range(n):
        torch.baddbmm(U0z[:, i], Wz[:, i], states[i], alpha=-1, out=U)
        torch.baddbmm(states[i] * gz[:, i], Ktz[:, i].mT, U, out=states[i + 1])
    return states


def transition_scan_backward(W, Kt, decay, X, Y, z: int):
    """``scan_chunks_backward`` from d(final) = [0 | I] with sources [X | 0], [Y | 0] (X [N, dk,
    dv], Y [N, C, dv]) -> ([dS(0) | Phi] [n + 1, z, dk, dv + dk], [dU(0) | Psi] [n, z, C, dv + dk]),
    scan order: dS[i] the gradient of chunk i's start state, dS[n] of the final state."""
    n, dk, dv = W.size(0) // z, W.size(-1), X.size(-1)
    Wz, Ktz, gz = W.unflatten(0, (z, n)), Kt.unflatten(0, (z, n)), decay.view(z, n, 1, 1)
    Xz, Yz = F.pad(X, (0, dk)).unflatten(0, (z, n)), F.pad(Y, (0, dk)).unflatten(0, (z, n))
    dS = X.new_empty((n + 1, z, dk, dv + dk))
    dU = Y.new_empty((n, z, Y.size(1), dv + dk))
    dS[-1] = _identity_columns(z, dk, dv, X)
    for i in range(n - 1, -1, -1):
        torch.baddbmm(Yz[:, i], Ktz[:, i], dS[i + 1], out=dU[i])
        torch.baddbmm(torch.addcmul(Xz[:, i], dS[i + 1], gz[:, i]), Wz[:, i].mT, dU[i], alpha=-1, out=dS[i])
    return dS, dU


def _affine(ext: torch.Tensor, h: torch.Tensor, dv: int) -> torch.Tensor:
    """ext [n, z, r, dv + dk] = [X0 | Pi] (scan order), h [z, dk, dv] -> X0 + Pi h [z n, r, dv]
    (chunk order): one batched product for every inner chunk, written in chunk order."""
    ext = ext.transpose(0, 1)                                           # [z, n, r, dv + dk], a view
    return torch.matmul(ext[..., dv:], h.unsqueeze(1)).add_(ext[..., :dv]).flatten(0, 1)


class ChunkGatedDeltaPassing(torch.autograd.Function):
    """(q, k, v, g, beta) in chunk_gated.py's layout over z = 2b * hv local chunk sequences, and the
    ``link`` -> o [N, C, dv] (fp32); the module docstring gives the scheme."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, link, z: int, fuse: bool, recompute: bool):
        heads, dv = Heads.of(q, v, z), v.size(-1)
        it = Intra(q, k, v, g, beta, heads)
        ext = transition_scan(it.W, it.U0, it.Kt, it.gam[:, -1], z)    # [n + 1, z, dk, dv + dk]
        h_in = link.states(ext[-1])                                    # [z, dk, dv]: R, M exchanged
        S = _affine(ext[:-1], h_in, dv)                                # true chunk-start states
        del ext
        U = torch.baddbmm(it.U0, it.W, S, alpha=-1)
        o = torch.baddbmm(it.M @ U, heads.per_value(q, it.gam.unsqueeze(-1)), S)  # M U + (q Gam) S
        ctx.link, ctx.z, ctx.fuse, ctx.recompute = link, z, fuse, recompute
        if recompute:
            ctx.save_for_backward(q, k, v, g, beta, h_in)
        else:
            ctx.save_for_backward(q, k, v, g, beta, S, it.D, it.KD, it.M, it.T, it.W, it.U0, U)
        return o

    @staticmethod
    def backward(ctx, dO):
        z = ctx.z
        saved = ctx.saved_tensors
        if ctx.recompute:  # rebuild what the forward would have kept, from the true start state
            q, k, v, g, beta, h_in = saved
            it = Intra(q, k, v, g, beta, Heads.of(q, v, z))
            S, U, _ = scan_chunks(it.W, it.U0, it.Kt, it.gam[:, -1], h_in)
            saved = (q, k, v, g, beta, S, it.D, it.KD, it.M, it.T, it.W, it.U0, U)
        q, k, v, g, beta, S, D, KD, M, T, W, U0, U = saved
        dO, heads, dv = dO.contiguous(), Heads.of(q, v, z), v.size(-1)
        gam_, tail_, Kt, Qg = factors = Factors.of(q, k, g, heads)
        dS, dU = transition_scan_backward(W, Kt, gam_[:, -1], Qg.mT @ dO, M.mT @ dO, z)
        d_out = ctx.link.gradients(dS[0, ..., :dv])                    # [z, dk, dv]: rho exchanged
        dSe, dU = _affine(dS[1:], d_out, dv), _affine(dU, d_out, dv)
        return (*input_grads(saved, dO, dSe, dU, heads, factors, ctx.fuse), None, None, None, None)


def chunk_gated_delta_rule_passing(q, k, v, g, beta, link, *, scale=None, chunk_size: int = 64, fuse: bool = False,
                                   recompute: bool = False):
    """``ChunkGatedDeltaPassing`` on the package's layout: chunk batches q, k [2b, n, hk, dk],
    v [2b, n, hv, dv], g, beta [2b, n, hv] -> o [2b, n, hv, dv] in v's dtype."""
    b2, t, hv, _ = v.shape
    dtype = v.dtype
    q, k, v, g, beta, _ = to_chunks(q, k, v, g, beta, scale, None, chunk_size)
    o = ChunkGatedDeltaPassing.apply(q, k, v, g, beta, link, b2 * hv, fuse, recompute)
    return from_chunks(o, b2, hv, t, dtype)


def _widened_run(chunked, q, k, v, g, beta, scale, chunk_size: int):
    """The chunked op over chunk batches with values [v | 0] and initial state [0 | I] ->
    (o_ext [2b, n, hv, dv + dk] = [o(0) | M_t^T q_t], final [2b, hv, dk, dv + dk] = [R | M])."""
    b2, n, hv, dv = v.shape
    dk = q.size(-1)
    v_ext = torch.cat([v, v.new_zeros(b2, n, hv, dk)], dim=-1)
    h0 = _identity_columns(b2 * hv, dk, dv, v.new_zeros((), dtype=torch.float32)).view(b2, hv, dk, dv + dk)
    return chunked(q, k, v_ext, g, beta, scale=scale, initial_state=h0, chunk_size=chunk_size)


def widened_passing(chunked, q, k, v, g, beta, link, *, scale=None, chunk_size: int = 64, recompute: bool = False):
    """Any chunked delta-rule op (``chunked``: a role's ``chunked``) over chunk batches (shapes as
    ``chunk_gated_delta_rule_passing``) through the link's autograd exchange (``link.incoming``).
    ``recompute``: the widened run keeps only its inputs and runs again in backward (so the op's
    own recompute option is not used)."""
    b2, n, hv, dv = v.shape
    dk = q.size(-1)
    run = _recomputed if recompute else lambda fn, *a: fn(*a)
    o_ext, final = run(_widened_run, chunked, q, k, v, g, beta, scale, chunk_size)
    h_in = link.incoming(final.reshape(b2 * hv, dk, dv + dk)).view(b2, hv, dk, dv)
    o0, qm = o_ext.split([dv, dk], dim=-1)                                    # o(0), M_t^T q_t
    qm = qm.to(h_in.dtype).transpose(1, 2).contiguous()                       # [2b, hv, n, dk], kept
    return o0 + (qm @ h_in).transpose(1, 2).to(o0.dtype)                      # + (M_t^T q_t) H_in
