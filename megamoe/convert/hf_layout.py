"""Typed transforms between HF linear-attention weights and megamoe's TP-shardable layout.

megamoe keeps each projection as one fused column-parallel ``in_proj`` whose rows are parts,
each part ordered by head, so TP splits every part by heads (``Shard(0, 'tp', parts)``):

    GDN  in_proj rows  [ q (hk*dk) | k (hk*dk) | v (hv*dv) | z (hv*dv) | b (hv) | a (hv) ]
         conv_weight   [ q | k | v ] x kernel                      (HF conv1d.weight [C, 1, K])
    KDA  in_proj rows  [ q (h*d) | k (h*d) | v (h*d) | b (h) ]
         conv_weight   [ q | k | v ] x kernel

Value head j reads key head j // (hv // hk) in both HF and megamoe, so a TP rank holding key
heads [i, i + hk/tp) holds exactly their value heads.

HF -> megamoe names (identical names and shapes are not listed):

    Qwen3-Next GDN   in_proj_qkvz + in_proj_ba -> in_proj      (qwen3_next_to_in_proj)
    Qwen3.5 GDN      in_proj_qkv, in_proj_z, in_proj_b, in_proj_a -> in_proj  (qwen3_5_to_in_proj)
    both             conv1d.weight -> conv_weight (conv_from_hf); A_log, dt_bias, norm.weight, out_proj
    kimi_linear /    q_proj, k_proj, v_proj, b_proj -> in_proj (kda_to_in_proj);
    glm5_next /      conv1d.weight -> conv_weight; forget_gate.A_log -> A_log (flattened: kimi
    bailing_hybrid   stores [1, 1, h, 1]); forget_gate.dt_bias -> dt_bias;
                     forget_gate.f_a_proj / f_b_proj -> forget_gate.down / forget_gate.up,
                     g_a_proj / g_b_proj -> output_gate.down / output_gate.up (low rank), or
                     forget_gate.f_proj / g_proj -> forget_gate.up / output_gate.up (bailing_hybrid);
                     o_norm.weight -> norm.weight; o_proj -> out_proj
"""
from __future__ import annotations

import torch

from megamoe.layers.mixers.gdn import GDNShapes  # noqa: F401  (the mixer's own in_proj layout)


def _check_rows(name: str, w: torch.Tensor, rows: int) -> None:
    if w.dim() != 2 or w.size(0) != rows:
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected [{rows}, hidden]")


def qwen3_next_to_in_proj(qkvz: torch.Tensor, ba: torch.Tensor, s: GDNShapes) -> torch.Tensor:
    """Qwen3-Next's per-key-head interleave -> megamoe ``in_proj``.

    in_proj_qkvz rows: for each key head g: [q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)];
    in_proj_ba rows: for each key head g: [b_g (r) | a_g (r)]   (r = hv / hk).
    """
    hk, r, dk, dv = s.key_heads, s.ratio, s.key_head_dim, s.value_head_dim
    _check_rows("in_proj_qkvz.weight", qkvz, hk * (2 * dk + 2 * r * dv))
    _check_rows("in_proj_ba.weight", ba, hk * 2 * r)
    hidden = qkvz.size(1)
    q, k, v, z = qkvz.reshape(hk, -1, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(hk, 2 * r, hidden).split([r, r], dim=1)
    return torch.cat([x.reshape(-1, hidden) for x in (q, k, v, z, b, a)], dim=0)


def in_proj_to_qwen3_next(w: torch.Tensor, s: GDNShapes) -> tuple[torch.Tensor, torch.Tensor]:
    """megamoe ``in_proj`` -> (in_proj_qkvz, in_proj_ba), the inverse of ``qwen3_next_to_in_proj``."""
    _check_rows("in_proj.weight", w, sum(s.in_proj_parts()))
    hk, hidden = s.key_heads, w.size(1)
    per_head = [x.reshape(hk, -1, hidden) for x in w.split(list(s.in_proj_parts()), dim=0)]
    qkvz = torch.cat(per_head[:4], dim=1).reshape(-1, hidden)
    ba = torch.cat(per_head[4:], dim=1).reshape(-1, hidden)
    return qkvz, ba


def qwen3_5_to_in_proj(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       s: GDNShapes) -> torch.Tensor:
    """Qwen3.5's separate projections (qkv already [q | k | v] by head) -> ``in_proj``."""
    q_, k_, v_, z_, b_, a_ = s.in_proj_parts()
    for name, w, rows in (("in_proj_qkv", qkv, q_ + k_ + v_), ("in_proj_z", z, z_), ("in_proj_b", b, b_),
                          ("in_proj_a", a, a_)):
        _check_rows(f"{name}.weight", w, rows)
    return torch.cat([qkv, z, b, a], dim=0)


def in_proj_to_qwen3_5(w: torch.Tensor, s: GDNShapes) -> tuple[torch.Tensor, ...]:
    """``in_proj`` -> (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    _check_rows("in_proj.weight", w, sum(s.in_proj_parts()))
    q, k, v, z, b, a = w.split(list(s.in_proj_parts()), dim=0)
    return torch.cat([q, k, v], dim=0), z, b, a


def kda_to_in_proj(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """kimi_linear / glm5_next / bailing_hybrid q_proj, k_proj, v_proj, b_proj -> ``in_proj``."""
    return torch.cat([q, k, v, b], dim=0)


def in_proj_to_kda(w: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``in_proj`` -> (q_proj, k_proj, v_proj, b_proj)."""
    width = num_heads * head_dim
    _check_rows("in_proj.weight", w, 3 * width + num_heads)
    return tuple(w.split([width, width, width, num_heads], dim=0))


def conv_from_hf(w: torch.Tensor) -> torch.Tensor:
    """HF depthwise ``conv1d.weight`` [C, 1, K] -> ``conv_weight`` [C, K]."""
    if w.dim() != 3 or w.size(1) != 1:
        raise ValueError(f"conv1d.weight has shape {tuple(w.shape)}, expected [channels, 1, kernel]")
    return w.squeeze(1)


def conv_to_hf(w: torch.Tensor) -> torch.Tensor:
    return w.unsqueeze(1)
