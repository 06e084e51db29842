"""Rotary position embeddings (rotate-half convention, as in HF Llama/Qwen), partial rotary;
interleaved pairs (MLA) and YaRN frequencies (every softmax mixer with RoPE: A, S, M, D).

Shapes: positions [b, s]; cos/sin [b, s, rot]; x [b, s, heads, head_dim] with the first
``rot`` channels rotated and the rest passed through.

Multimodal RoPE (Qwen3-VL / Qwen3.5, interleaved): positions [3, b, s] hold a (t, h, w)
position per token; frequency pair i takes its angle from axis h when ``i % 3 == 1`` and
``i < 3 * sections[1]``, from w when ``i % 3 == 2`` and ``i < 3 * sections[2]``, else from t.
Text tokens have t = h = w, which reduces to plain RoPE.
"""
from __future__ import annotations

import math
from dataclasses import astuple

import torch

from megamoe.core.config import YarnConfig
from megamoe.layers.spec import ForwardInfo


def inv_freq(rot_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=device) / rot_dim))


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [b, s] -> (cos, sin) [b, s, rot_dim] in fp32."""
    freqs = positions.to(torch.float64).unsqueeze(-1) * inv_freq(rot_dim, theta, positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def mrope_axis(rot_dim: int, sections, device=None) -> torch.Tensor:
    """[rot_dim/2] long: the axis (0=t, 1=h, 2=w) each frequency pair reads, interleaved layout."""
    i = torch.arange(rot_dim // 2, device=device)
    axis = torch.zeros_like(i)
    axis[(i % 3 == 1) & (i < 3 * sections[1])] = 1
    axis[(i % 3 == 2) & (i < 3 * sections[2])] = 2
    return axis


def mrope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float, sections
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, b, s] (t, h, w) -> (cos, sin) [b, s, rot_dim] in fp32."""
    freqs = positions.to(torch.float64).unsqueeze(-1) * inv_freq(rot_dim, theta, positions.device)
    axis = mrope_axis(rot_dim, sections, positions.device)
    freqs = freqs.gather(0, axis.view(1, 1, 1, -1).expand(1, *freqs.shape[1:])).squeeze(0)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def cached_cos_sin(info: ForwardInfo, rot_dim: int, theta: float, fn=rope_cos_sin, sections=None):
    """cos/sin shared by every layer with the same rotary parameters within one forward.

    ``sections``: the layer's multimodal RoPE sections; used when ``info.positions`` is
    [3, b, s]. A layer without sections given [3, b, s] positions rotates by the t row (the
    text position), so mixers that know nothing of images still work in a multimodal model.
    """
    key = ("rope", fn.__name__, rot_dim, theta, tuple(sections or ()))
    if key not in info.memo:
        pos = info.positions
        if pos.dim() == 3 and sections:
            info.memo[key] = mrope_cos_sin(pos, rot_dim, theta, sections)
        else:
            info.memo[key] = fn(pos[0] if pos.dim() == 3 else pos, rot_dim, theta)
    return info.memo[key]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d]; cos/sin [b, s, rot] with rot <= d. Rotation in fp32, result in x.dtype."""
    rot = cos.size(-1)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    x_rot = x[..., :rot].float()
    out = x_rot * c + rotate_half(x_rot) * s
    if rot == x.size(-1):
        return out.to(x.dtype)
    return torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)


# ---- interleaved pairs and YaRN (DeepSeek / Ling MLA) ----------------------------------------

def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek checkpoints' layout).

    x [b, s, h, rot]; cos/sin [b, s, rot] as built by ``rope_cos_sin`` (``cat(freqs, freqs)``).
    The result comes out de-interleaved (evens then odds), as in HF: the same permutation is
    applied to queries and keys, so their dot products are those of the pairwise rotation.
    """
    evens_odds = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return apply_rotary(evens_odds, cos, sin)


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs of the LAST ``rot`` channels, the layout kept (DeepSeek-V4): pair
    i = (x[d-rot+2i], x[d-rot+2i+1]) turns by angle i; the leading channels pass through.

    x [b, s, h, d]; cos/sin [b, s, rot] as ``rope_cos_sin`` builds them (``cat(freqs, freqs)``;
    pair i reads entry i). Keys that are also values are turned back by passing ``-sin``."""
    rot = cos.size(-1)
    c, s = cos[..., : rot // 2].unsqueeze(2), sin[..., : rot // 2].unsqueeze(2)
    r = x[..., x.size(-1) - rot:].float()
    even, odd = r[..., 0::2], r[..., 1::2]
    turned = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : x.size(-1) - rot], turned], dim=-1)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_cos_sin_scale(yarn: YarnConfig) -> float:
    """Factor on cos/sin (HF ``attention_factor``)."""
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def yarn_softmax_scale(yarn: YarnConfig) -> float:
    """Factor on the softmax scale (HF ``yarn_apply_mscale``): mscale(factor, all_dim)^2."""
    return yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2 if yarn.mscale_all_dim else 1.0


def yarn_inv_freq(yarn: YarnConfig, rot_dim: int, theta: float, device=None) -> torch.Tensor:
    """Per-pair frequencies: extrapolated (high) and interpolated (/factor, low) blended by a ramp."""
    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rot_dim - 1)
    high = high + 0.001 if low == high else high  # avoid a zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    extra = inv_freq(rot_dim, theta, device)
    return extra / yarn.factor * ramp + extra * (1 - ramp)


def yarn_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float, yarn: YarnConfig):
    """positions [b, s] -> (cos, sin) [b, s, rot_dim] in fp32, YaRN frequencies and scale."""
    freqs = positions.to(torch.float64).unsqueeze(-1) * yarn_inv_freq(yarn, rot_dim, theta, positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = yarn_cos_sin_scale(yarn)
    return (emb.cos() * scale).float(), (emb.sin() * scale).float()


def cached_yarn_cos_sin(info: ForwardInfo, rot_dim: int, theta: float, yarn: YarnConfig):
    """Like ``cached_cos_sin``; plain RoPE tables when the YaRN factor is <= 1."""
    if yarn.factor <= 1:
        return cached_cos_sin(info, rot_dim, theta)
    key = ("rope", "yarn", rot_dim, theta, *astuple(yarn))
    if key not in info.memo:
        pos = info.positions
        info.memo[key] = yarn_cos_sin(pos[0] if pos.dim() == 3 else pos, rot_dim, theta, yarn)  # text row
    return info.memo[key]
