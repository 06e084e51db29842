"""Projectors: encoder patch features -> language-model tokens.

Both take patch features ``x [b, gh*gw, d]`` on a ``(gh, gw)`` grid (row-major) and return
``([b, n, out], (gh', gw'))``:

- ``MLPProjector`` (LLaVA): one LM token per patch, Linear(d, hid) - GELU - Linear(hid, out).
  Parameters: d*hid + hid + hid*out + out.
- ``PatchMerger`` (Qwen-VL, Kimi-K2.5): LayerNorm(d) (eps ``projector_norm_eps``), each k x k block of patches concatenated (row-major
  inside the block) into one k*k*d vector, Linear(k²d, k²d) - GELU - Linear(k²d, out); one LM
  token per block, so k*k fewer tokens. Parameter names (norm, fc1, fc2) match timm's
  ``Qwen3VitPatchMerger``, so the merger of an HF Qwen3.5 checkpoint loads as-is.
  Parameters: 2d + (k²d)² + k²d + k²d*out + out. ``norm_after_merge`` (Qwen3-VL's deepstack
  mergers) normalises the merged k²d vector instead: 2k²d + (k²d)² + k²d + k²d*out + out.
- ``GlmMerger`` (GLM-5): each k x k block of patches -> one token by a strided Conv2d (d -> out),
  then Linear(out, out) without bias, LayerNorm, GELU and a SwiGLU out -> hidden -> out whose
  gate is clamped at ``limit`` from above and its up projection to [-limit, limit] (no biases).
  Parameters: k²d*out + out + out² + 2out + 3*out*hidden.
- ``MLPMerger`` (MiniMax-M3): the MLP projector per patch (Linear(d, hid) - GELU - Linear(hid,
  out)), then each k x k block of projected patches concatenated (row-major) and merged by
  Linear(k²out, hid) - GELU - Linear(hid, out). Parameters: (d + 1)hid + (hid + 1)out
  + (k²out + 1)hid + (hid + 1)out.
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
    def __init__(self, dim: int, out: int, merge_size: int = 2, init_std: float = 0.02, eps: float = 1e-6,
                 norm_after_merge: bool = False):
        super().__init__()
        self.merge_size = k = merge_size
        self.norm_after_merge = norm_after_merge  # Qwen3-VL's deepstack mergers: LayerNorm(k*k*d)
        self.norm = nn.LayerNorm(k * k * dim if norm_after_merge else dim, eps=eps)
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
        if self.norm_after_merge:
            x, grid = self.merge(x, grid)
            x = self.norm(x)
        else:
            x, grid = self.merge(self.norm(x), grid)
        return self.fc2(self.act(self.fc1(x))), grid


class GlmMerger(nn.Module):
    def __init__(self, dim: int, out: int, hidden: int, merge_size: int = 2, limit: float | None = None,
                 init_std: float = 0.02, eps: float = 1e-5):
        super().__init__()
        self.merge_size, self.limit = merge_size, limit
        self.downsample = nn.Conv2d(dim, out, kernel_size=merge_size, stride=merge_size)
        mark_init(self.downsample.weight, normal_init(init_std))
        mark_init(self.downsample.bias, const_init(0.0))
        self.norm = nn.LayerNorm(out, eps=eps)
        mark_init(self.norm.weight, const_init(1.0))
        mark_init(self.norm.bias, const_init(0.0))
        self.proj, self.down_proj = nn.Linear(out, out, bias=False), nn.Linear(hidden, out, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(out, hidden, bias=False), nn.Linear(out, hidden, bias=False)
        for lin in (self.proj, self.gate_proj, self.up_proj, self.down_proj):
            mark_init(lin.weight, normal_init(init_std))

    def forward(self, x: torch.Tensor, grid: tuple[int, int]):
        """[b, gh*gw, d] -> ([b, (gh/k)*(gw/k), out], (gh/k, gw/k))."""
        (gh, gw), k = grid, self.merge_size
        if gh % k or gw % k:
            raise ValueError(f"patch grid {gh}x{gw} is not divisible by merge_size={k}")
        b, _, d = x.shape
        x = self.downsample(x.reshape(b, gh, gw, d).permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)
        x = nn.functional.gelu(self.norm(self.proj(x)))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(nn.functional.silu(gate) * up), (gh // k, gw // k)
class MLPMerger(nn.Module):
    def __init__(self, dim: int, out: int, hidden: int, merge_size: int = 2, init_std: float = 0.02):
        super().__init__()
        self.merge_size = k = merge_size
        self.patch = MLPProjector(dim, out, hidden, init_std)
        self.merge_fc1 = _linear(k * k * out, hidden, init_std)
        self.act = nn.GELU()
        self.merge_fc2 = _linear(hidden, out, init_std)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]):
        x, grid = PatchMerger.merge(self, self.patch(x, grid)[0], grid)
        return self.merge_fc2(self.act(self.merge_fc1(x))), grid


def build_projector(cfg: VisionConfig, dim: int, out: int, init_std: float = 0.02) -> nn.Module:
    if cfg.projector == "mlp":
        return MLPProjector(dim, out, cfg.projector_hidden or out, init_std)
    if cfg.projector == "merger":
        return PatchMerger(dim, out, cfg.merge_size, init_std, eps=cfg.projector_norm_eps)
    if cfg.projector == "glm_merger":
        return GlmMerger(dim, out, cfg.projector_hidden or 4 * out, cfg.merge_size, cfg.projector_swiglu_limit,
                         init_std, eps=cfg.projector_norm_eps)
    if cfg.projector == "mlp_merger":
        return MLPMerger(dim, out, cfg.projector_hidden or out, cfg.merge_size, init_std)
    raise ConfigError(f"model.vision.projector={cfg.projector!r} is invalid: allowed: mlp, merger, glm_merger, "
                      "mlp_merger")
