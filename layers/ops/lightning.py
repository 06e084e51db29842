"""Lightning attention's operator (MiniMax-01): linear attention with a fixed decay per head.

Per head, with slope ``s > 0`` and state ``S`` [dk, dv]::

    S_t = exp(-s) S_{t-1} + k_t^T v_t        o_t = q_t S_t

no softmax scale and no normalisation inside the recurrence. Three forms (shapes: q, k
[b, t, h, dk], v [b, t, h, dv], slope [h], state [b, h, dk, dv] in fp32; outputs in v's dtype,
final state in fp32 or float64):

- ``lightning_naive``: the closed form with a [t, t] decay matrix (reference);
- ``lightning_recurrent``: token by token (decoding);
- ``lightning_chunked``: blocks of ``block`` tokens, batched inside blocks, a short scan across
  (training). All exponents are <= 0 (decays are only ever raised to distances), so no block
  size overflows.

``resets`` [b, t] bool (the recurrent and chunked forms; packed documents): True where a token
starts a new document, so the state is zeroed before that token's update and nothing before it
is seen from it or after it. The mixer is ``megamoe.layers.mixers.lightning``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32, or float64 for float64 inputs


def _heads_first(*xs: torch.Tensor, dtype: torch.dtype):
    return [x.to(dtype).transpose(1, 2) for x in xs]  # [b, t, h, d] -> [b, h, t, d]


def _initial(state: torch.Tensor | None, b: int, h: int, dk: int, dv: int, dtype, device) -> torch.Tensor:
    if state is None:
        return torch.zeros(b, h, dk, dv, dtype=dtype, device=device)
    return state.to(dtype)


def lightning_naive(q, k, v, slope, initial_state=None):
    """Closed form: o_i = sum_{j<=i} exp(-s (i-j)) (q_i.k_j) v_j + exp(-s i) q_i S0 (i, j 1-based)."""
    dt = _work_dtype(v)
    b, t, h, dk = q.shape
    qh, kh, vh = _heads_first(q, k, v, dtype=dt)
    s = slope.to(dt).view(h, 1, 1)
    pos = torch.arange(1, t + 1, dtype=dt, device=q.device)
    dist = pos[:, None] - pos[None, :]
    decay = torch.where(dist >= 0, torch.exp(-s * dist.clamp(min=0)), torch.zeros((), dtype=dt, device=q.device))
    s0 = _initial(initial_state, b, h, dk, v.size(-1), dt, q.device)
    o = ((qh @ kh.transpose(-1, -2)) * decay) @ vh + (qh * torch.exp(-s * pos[:, None])) @ s0
    final = torch.exp(-s * t) * s0 + (kh * torch.exp(-s * (t - pos)[:, None])).transpose(-1, -2) @ vh
    return o.transpose(1, 2).to(v.dtype), final


def lightning_recurrent(q, k, v, slope, initial_state=None, resets=None):
    """Token by token; the decoding step (t = 1) and the readable reference."""
    dt = _work_dtype(v)
    b, t, h, dk = q.shape
    qh, kh, vh = _heads_first(q, k, v, dtype=dt)
    lam = torch.exp(-slope.to(dt)).view(1, h, 1, 1)
    state = _initial(initial_state, b, h, dk, v.size(-1), dt, q.device)
    outs = []
    for i in range(t):
        if resets is not None:  # a document starts here: forget the state
            state = state * (~resets[:, i]).to(dt).view(b, 1, 1, 1)
        state = lam * state + kh[:, :, i, :, None] * vh[:, :, i, None, :]
        outs.append((qh[:, :, i, None, :] @ state).squeeze(2))
    return torch.stack(outs, dim=1).to(v.dtype), state


def lightning_chunked(q, k, v, slope, initial_state=None, block: int = 64, resets=None):
    """Blocks of ``block`` tokens (the last one may be short). Within block n, with S_n the state
    at its start and 1-based positions i, j::

        o_i  = exp(-s i) q_i S_n + sum_{j<=i} exp(-s (i-j)) (q_i.k_j) v_j
        S_n+1 = exp(-s c_n) S_n + sum_j exp(-s (c_n - j)) k_j^T v_j        (c_n: block length)

    With ``resets`` each term is kept only when no document starts between its two ends
    (``_reset_masks``)."""
    dt = _work_dtype(v)
    b, t, h, dk = q.shape
    dv = v.size(-1)
    n = -(-t // block)
    pad = n * block - t
    qh, kh, vh = (F.pad(x, (0, 0, 0, pad)).view(b, h, n, block, -1) for x in _heads_first(q, k, v, dtype=dt))
    dev = q.device
    s = slope.to(dt).view(1, h, 1, 1, 1)
    pos = torch.arange(1, block + 1, dtype=dt, device=dev)
    lens = torch.full((n,), float(block), dtype=dt, device=dev)
    lens[-1] = t - (n - 1) * block
    dist = pos[:, None] - pos[None, :]
    diag = torch.where(dist >= 0, torch.exp(-s * dist.clamp(min=0)), torch.zeros((), dtype=dt, device=dev))
    to_end = lens[:, None, None] - pos[None, :, None]  # [n, block, 1]; < 0 only on padding (k = 0)
    k_decay = torch.exp(-s * to_end.clamp(min=0))
    block_decay = torch.exp(-s.view(1, h, 1, 1) * lens.view(n, 1, 1, 1))  # [n, h, 1, 1]
    q_decay = torch.exp(-s * pos[:, None])  # [1, h, 1, block, 1]: from the block start
    if resets is not None:
        same, sees_start, reaches_end, keeps = _reset_masks(F.pad(resets, (0, pad)).view(b, 1, n, block), dt)
        diag, q_decay, k_decay = diag * same, q_decay * sees_start, k_decay * reaches_end
        block_decay = block_decay.unsqueeze(1) * keeps.permute(2, 0, 1)[..., None, None]  # [n, b, h, 1, 1]
    intra = ((qh @ kh.transpose(-1, -2)) * diag) @ vh  # [b, h, n, block, dv]
    updates = (kh * k_decay).transpose(-1, -2) @ vh  # [b, h, n, dk, dv]
    state = _initial(initial_state, b, h, dk, dv, dt, dev)
    starts = []
    for m in range(n):  # the only sequential part: one [dk, dv] update per block
        starts.append(state)
        state = block_decay[m] * state + updates[:, :, m]
    inter = (qh * q_decay) @ torch.stack(starts, dim=2)
    o = (intra + inter).reshape(b, h, n * block, dv)[:, :, :t]
    return o.transpose(1, 2).to(v.dtype), state


def _reset_masks(resets: torch.Tensor, dtype):
    """resets [b, 1, n, block] bool -> 0/1 factors: ``same`` [b, 1, n, block, block] (i sees j: no
    document starts in (j, i]), ``sees_start`` [b, 1, n, block, 1] (no start in [0, i]: i sees the
    block's start state), ``reaches_end`` [b, 1, n, block, 1] (no start in (j, end]: key j reaches
    the block's end state), ``keeps`` [b, 1, n] (no start in the block: the start state reaches
    the end)."""
    cnt = resets.long().cumsum(-1)  # starts in [0, i]
    same = (cnt.unsqueeze(-1) == cnt.unsqueeze(-2)).to(dtype)
    return (same, (cnt == 0).to(dtype).unsqueeze(-1), (cnt == cnt[..., -1:]).to(dtype).unsqueeze(-1),
            (cnt[..., -1] == 0).to(dtype))
