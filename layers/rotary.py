"""Rotary position embeddings (rotate-half convention, as in HF Llama/Qwen), partial rotary.

Shapes: positions [b, s]; cos/sin [b, s, rot]; x [b, s, heads, head_dim] with the first
``rot`` channels rotated and the rest passed through.
"""
from __future__ import annotations

import torch

from megamoe.spec import ForwardInfo


def inv_freq(rot_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=device) / rot_dim))


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [b, s] -> (cos, sin) [b, s, rot_dim] in fp32."""
    freqs = positions.to(torch.float64).unsqueeze(-1) * inv_freq(rot_dim, theta, positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def cached_cos_sin(info: ForwardInfo, rot_dim: int, theta: float, fn=rope_cos_sin):
    """cos/sin shared by every layer with the same rotary parameters within one forward."""
    key = ("rope", fn.__name__, rot_dim, theta)
    if key not in info.memo:
        info.memo[key] = fn(info.positions, rot_dim, theta)
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
