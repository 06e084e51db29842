"""What megamoe's timm-style towers share (Kimi-K2.5's ``kimi_vit``, GLM-5's ``glm_vit``,
MiniMax-M3's ``minimax_vit``): timm's encoder interface around a stack of blocks called as
``block(tokens, rope=rope)``.

A subclass calls ``init_common`` in its ``__init__``, builds its patch embedding, ``blocks`` and
final ``norm`` (``nn.Identity()`` for none), and defines::

    _embed(images [b, 3, H, W]) -> (tokens [b, gh*gw, d], rope [gh*gw, 2*head_dim], (gh, gw))

It then has timm's ``forward_features`` (``[b, gh, gw, d]``, output_fmt NHWC),
``forward_intermediates`` (block outputs at given indices, before the final norm, as timm's
ViTs; Qwen3-VL-style deepstack reads these), gradient checkpointing and ``feature_info``.
"""
from __future__ import annotations

import torch
from torch import nn
from timm.layers import trunc_normal_
from timm.models._manipulate import checkpoint

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def pretrained_cfg(input_size: int, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), **kwargs) -> dict:
    """timm's pretrained-config record of a tower without downloadable weights (any input size)."""
    return {"url": "", "input_size": (3, input_size, input_size), "pool_size": None, "fixed_input_size": False,
            "crop_pct": 1.0, "interpolation": "bicubic", "mean": mean, "std": std, "num_classes": 0,
            "first_conv": "patch_embed.proj", **kwargs}


class NativeVit(nn.Module):
    output_fmt: str = "NHWC"

    def init_common(self, embed_dim: int, num_heads: int, depth: int, patch_size: int, rope_temperature: float,
                    head_multiple: int = 2):
        # the 2-D rotary embedding splits a head into (row, column) halves, each rotated in pairs
        if embed_dim % num_heads or (embed_dim // num_heads) % head_multiple:
            raise ValueError(f"embed_dim={embed_dim} / num_heads={num_heads} must be a head size divisible by "
                             f"{head_multiple}")
        self.num_classes, self.num_prefix_tokens = 0, 0
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.head_dim, self.rope_temperature = embed_dim // num_heads, rope_temperature
        self.grad_checkpointing = False
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=patch_size) for i in range(depth)]

    def init_linears(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def _blocks(self, x: torch.Tensor, rope: torch.Tensor, taps=()):
        kept = []
        for i, blk in enumerate(self.blocks):
            x = checkpoint(blk, x, rope=rope) if self.grad_checkpointing else blk(x, rope=rope)
            if i in taps:
                kept.append(x)
        return x, kept

    def forward_intermediates(self, x: torch.Tensor, indices=None, output_fmt: str = "NLC",
                              intermediates_only: bool = False, **_):
        """(features [b, gh, gw, d], block outputs at ``indices`` [b, gh*gw, d] or NCHW)."""
        taps = range(len(self.blocks)) if indices is None else list(indices)
        x, rope, (gh, gw) = self._embed(x)
        x, kept = self._blocks(x, rope, taps)
        if output_fmt == "NCHW":
            kept = [y.reshape(y.size(0), gh, gw, -1).permute(0, 3, 1, 2) for y in kept]
        if intermediates_only:
            return kept
        return self.norm(x).reshape(x.size(0), gh, gw, -1), kept

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, rope, (gh, gw) = self._embed(x)
        return self.norm(self._blocks(x, rope)[0]).reshape(x.size(0), gh, gw, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x)
