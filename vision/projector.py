"""Projectors: encoder patch features -> language-model tokens.

Both take patch features ``x [b, gh*gw, d]`` on a ``(gh, gw)`` grid (row-major) and return
``([b, n, out], (gh', gw'))``:

- ``MLPProjector`` (LLaVA): one LM token per patch, Linear(d, hid) - GELU - Linear(hid, out).
  Parameters: d*hid + hid + hid*out + out.
- ``PatchMerger`` (Qwen-VL, Kimi-K2.5): LayerNorm(d) (eps ``projector_norm_eps``), each k x k block of patches concatenated (row-major
  inside the block) into one k*k*d vector, Linear(k²d, k²d) - GELU - Linear(k²d, out); one LM
  token per block, so k*k fewer tokens. Parameter names (norm, fc1, fc2) match timm's
  ``Qwen3VitPatchMerger``, so the merger of an HF Qwen3.5 checkpoint loads as-is.
  Parameters: 2d + (k²d)² + k²d + k²d*out + out.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.core.config import VisionConfig
from megamoe.core.errors import ConfigError
from megamoe.parallel.sharding import const_init, mark_init, normal_init


def _linear(d_in: int, d_out: int, std: float) -> nn.Linear:
    lin = nn.Linear(d_in, d_out)
    mark_init(lin.weight, normal_init(std))
    mark_init(lin.bias, const_init(0.0))
    return lin


class MLPProjector(nn.Module):
    def __init__(self, dim: int, out: int, hidden: int, init_std: float = 0.02):
        super().__init__()
        self.merge_size = 1
        self.fc1 = _linear(dim, hidden, init_std)
        self.act = nn.GELU()
        self.fc2 = _linear(hidden, out, init_std)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]):
        return self.fc2(self.act(self.fc1(x))), grid


class PatchMerger(nn.Module):
    def __init__(self, dim: int, out: int, merge_size: int = 2, init_std: float = 0.02, eps: float = 1e-6):
        super().__init__()
        self.merge_size = k = merge_size
        self.norm = nn.LayerNorm(dim, eps=eps)
        mark_init(self.norm.weight, const_init(1.0))
        mark_init(self.norm.bias, const_init(0.0))
        self.fc1 = _linear(k * k * dim, k * k * dim, init_std)
        self.act = nn.GELU()
        self.fc2 = _linear(k * k * dim, out, init_std)

    def merge(self, x: torch.Tensor, grid: tuple[int, int]):
        """[b, gh*gw, d] -> [b, (gh/k)*(gw/k), k*k*d]."""
        (gh, gw), k = grid, self.merge_size
        if gh % k or gw % k:
            raise ValueError(f"patch grid {gh}x{gw} is not divisible by merge_size={k} "
                             "(resize images to multiples of patch size x merge size)")
        b, _, d = x.shape
        x = x.reshape(b, gh // k, k, gw // k, k, d).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(b, (gh // k) * (gw // k), k * k * d), (gh // k, gw // k)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]):
        x, grid = self.merge(self.norm(x), grid)
        return self.fc2(self.act(self.fc1(x))), grid


def build_projector(cfg: VisionConfig, dim: int, out: int, init_std: float = 0.02) -> nn.Module:
    if cfg.projector == "mlp":
        return MLPProjector(dim, out, cfg.projector_hidden or out, init_std)
    if cfg.projector == "merger":
        return PatchMerger(dim, out, cfg.merge_size, init_std, eps=cfg.projector_norm_eps)
    raise ConfigError(f"model.vision.projector={cfg.projector!r} is invalid: allowed: mlp, merger")
