"""The gated delta rule, token by token: the readable reference and the decoding step.

One recurrence serves Gated DeltaNet (one decay per head) and KDA (one decay per key
channel). Per head, with state ``S`` of shape [dk, dv] and ``a_t = exp(g_t)``::

    S_t = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

Shapes (all operators in this package):
    q, k          [b, t, hk, dk]   (hk divides hv; value head j reads key head j // (hv // hk))
    v             [b, t, hv, dv]
    g             [b, t, hv] (per-head decay, GDN) or [b, t, hv, dk] (per-channel, KDA); log space, <= 0
    beta          [b, t, hv]
    initial_state [b, hv, dk, dv] or None (zeros)
    returns       o [b, t, hv, dv] in v's dtype, final state [b, hv, dk, dv] in fp32.
The state is always accumulated in fp32 (fp64 when the inputs are fp64, for references).
"""
from __future__ import annotations

import torch


def expand_key_heads(q: torch.Tensor, k: torch.Tensor, value_heads: int):
    """Repeat each key head for the value heads it serves: [b, t, hk, d] -> [b, t, hv, d]."""
    hk = k.size(2)
    if value_heads % hk:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({hk})")
    if value_heads == hk:
        return q, k
    rep = value_heads // hk
    return q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)


def prepare(q, k, v, g, beta, scale, initial_state, expand: bool = True):
    """fp32, heads expanded (unless not ``expand``: q, k keep their key heads), time moved next
    to the features: [b, h, t, d]; g as [b, h, t, dk|1]."""
    b, t, hv, dv = v.shape
    dk = q.size(-1)
    if expand:
        q, k = expand_key_heads(q, k, hv)
    elif hv % k.size(2):
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({k.size(2)})")
    scale = dk ** -0.5 if scale is None else scale
    acc = torch.promote_types(v.dtype, torch.float32)  # fp32, or fp64 for references
    q = q.to(acc).transpose(1, 2)
    if scale != 1.0:
        q = q * scale
    k, v = (x.to(acc).transpose(1, 2) for x in (k, v))
    g = g.to(acc).transpose(1, 2)
    if g.dim() == 3:  # per-head decay: one value for every key channel
        g = g.unsqueeze(-1)
    beta = beta.to(acc).transpose(1, 2)
    if initial_state is None:
        state = v.new_zeros(b, hv, dk, dv)
    else:
        if tuple(initial_state.shape) != (b, hv, dk, dv):
            raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(b, hv, dk, dv)}")
        state = initial_state.to(acc)
    return q, k, v, g, beta, state


def naive_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None):
    """Reference: the recurrence exactly as written above, with explicit [dk, dk] matrices.

    Slow (O(t * dk^2 * dv)) and meant for tests; see the module docstring for shapes.
    """
    dtype = v.dtype
    q, k, v, g, beta, state = prepare(q, k, v, g, beta, scale, initial_state)
    eye = torch.eye(q.size(-1), dtype=state.dtype, device=state.device)
    outs = []
    for q_t, k_t, v_t, g_t, b_t in zip(*(x.unbind(2) for x in (q, k, v, g, beta))):
        b_t = b_t[..., None, None]
        decayed = g_t.exp().unsqueeze(-1) * state                                # diag(a_t) S
        erase = eye - b_t * k_t.unsqueeze(-1) * k_t.unsqueeze(-2)                # I - beta k k^T
        state = erase @ decayed + b_t * k_t.unsqueeze(-1) * v_t.unsqueeze(-2)   # + beta k v^T
        outs.append((state.transpose(-1, -2) @ q_t.unsqueeze(-1)).squeeze(-1))  # S^T q
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.size(0), 0, v.size(1), v.size(3))
    return o.to(dtype), state


def recurrent_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None):
    """Decoding form: the same recurrence as a read-correct-write step, O(dk * dv) per token.

    ``S <- a*S; S <- S + k (beta (v - S^T k))^T`` avoids the [dk, dk] matrices of the reference.
    Out-of-place, so it is differentiable (used for short continuations as well as one token).
    """
    if q.size(1) == 1 and initial_state is not None and not torch.is_grad_enabled():
        return delta_rule_step(q, k, v, g, beta, scale=scale, state=initial_state)
    dtype = v.dtype
    q, k, v, g, beta, state = prepare(q, k, v, g, beta, scale, initial_state)
    outs = []
    # the state [b, h, dk, dv] is the big operand at decode: each line reads it once (matmuls
    # for S^T k and S^T q, one addcmul for the update) instead of materialising products of it
    for q_t, k_t, v_t, g_t, b_t in zip(*(x.unbind(2) for x in (q, k, v, g, beta))):
        state = state * g_t.exp().unsqueeze(-1)
        predicted = (k_t.unsqueeze(-2) @ state).squeeze(-2)                # S^T k   [b, h, dv]
        delta = (v_t - predicted) * b_t.unsqueeze(-1)
        state = torch.addcmul(state, k_t.unsqueeze(-1), delta.unsqueeze(-2))
        outs.append((q_t.unsqueeze(-2) @ state).squeeze(-2))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.size(0), 0, v.size(1), v.size(3))
    return o.to(dtype), state


def delta_rule_step(q, k, v, g, beta, *, scale=None, state: torch.Tensor):
    """One decode token of ``recurrent_delta_rule`` (t = 1, a state given, no autograd): the same
    lines in the same order, so the same values, without ``prepare``'s per-call transposes,
    casts and the loop: with t = 1, [b, 1, h, d] is [b, h, 1, d] by a view. The state is
    updated in place after its decay (a new tensor), so the caller's state is left unchanged."""
    b, _, hv, dv = v.shape
    dk, dtype = q.size(-1), v.dtype
    acc = torch.promote_types(dtype, torch.float32)
    q, k = expand_key_heads(q, k, hv)
    q, k, v = (x.to(acc).view(b, hv, 1, x.size(-1)) for x in (q, k, v))  # [b, h, 1, d]
    scale = dk ** -0.5 if scale is None else scale
    if scale != 1.0:
        q = q * scale
    decay = g.to(acc).view(b, hv, -1).exp().unsqueeze(-1)                # [b, h, dk | 1, 1]
    state = state.to(acc) * decay                                         # [b, h, dk, dv]
    flat = state.view(b * hv, dk, dv)  # bmm on views: matmul's broadcasting copied k and q
    predicted = torch.bmm(k.reshape(b * hv, 1, dk), flat).view(b, hv, 1, dv)  # S^T k
    delta = (v - predicted).mul_(beta.to(acc).view(b, hv, 1, 1))
    state.addcmul_(k.transpose(-1, -2), delta)
    o = torch.bmm(q.reshape(b * hv, 1, dk), flat)                         # S^T q   [b h, 1, dv]
    return o.view(b, 1, hv, dv).to(dtype), state
