"""MiniMax-M3's vision tower (transformers' ``minimax_m3_vl_vision``) as a timm encoder.

timm has no such tower, so this one is written in timm's style and registered in timm's model
registry (``timm.create_model("minimax_m3_vit_enc", embed_dim=..., ...)``), the way
``megamoe.vision.TimmEncoder`` builds every encoder. It is a CLIP-style ViT with 3D rotary
positions; the blocks are timm's ``EvaBlock`` (pre-LayerNorm, ``AttentionRope`` with a fused
biased ``qkv``, exact-GELU ``Mlp``), so ``megamoe.vision.tensor_parallel`` splits them as any
timm ViT::

    images [b, 3, H, W] -> Conv3d patch (T x p x p, no bias) on T identical frames
      -> LayerNorm (norm_pre) -> depth x EvaBlock(rope = thw_rope(gh, gw)) -> [b, gh, gw, d] (NHWC)

There is no final norm (transformers' tower returns the last block's output). The Conv3d
weight ``[d, 3, T, p, p]`` is kept as released; an image is T copies of one frame, so the
patch embedding is a Conv2d with the weight summed over T (video, frames that differ, is not
covered).

RoPE (transformers' axial ``MiniMaxM3VLVisionRotaryEmbedding``): with ``s = 2*((D//3)//2)``
channels per axis and ``r = 3s`` rotated channels of each head of width D, HF rotates pairs
``(i, i + r/2)`` of the first r channels by angle ``pos_a * theta^(-2j/s)`` (axis a = t, h, w
for i in [0, s/2), [s/2, s), [s, 3s/2), j = i mod s/2) and passes the last D - r through.
timm's rotate-half pairs ``(i, i + D/2)`` over the whole head, so this encoder stores each
head's q and k channels permuted (``rope_permutation``: the r/2 first and second halves of the
rotated channels to the starts of the two halves, the passed-through ones after them) and
gives the passed-through pairs angle 0; scores are those of HF's layout (the same permutation
of q and k). Images have t = 0, so the t pairs do not turn.

Parameters (d, depth L, MLP width f, patch p, T frames): 3Tp²d + 2d + L(4d² + 4d + 2df + f + d + 4d).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import LayerNorm, calculate_drop_path_rates, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.eva import EvaBlock

from megamoe.vision.kimi_vit import mlp_ratio_for
from megamoe.vision.native_vit import CLIP_MEAN, CLIP_STD, NativeVit, pretrained_cfg

__all__ = ["MiniMaxVitEncoder", "rope_permutation", "thw_rope"]


def rotated_dim(head_dim: int) -> int:
    """HF's rotated channels per head: 3 axes of 2*((D//3)//2)."""
    return 3 * 2 * ((head_dim // 3) // 2)


def rope_permutation(head_dim: int) -> torch.Tensor:
    """[D] long: timm channel j of a head holds HF channel perm[j] (module docstring)."""
    r, half = rotated_dim(head_dim), head_dim // 2
    rest = torch.arange(r, head_dim)
    return torch.cat([torch.arange(r // 2), rest[:half - r // 2], torch.arange(r // 2, r), rest[half - r // 2:]])


def thw_rope(size: tuple[int, int], head_dim: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """[h*w, 2*head_dim] float32 ``[sin | cos]`` angles (timm's cat form) of a (h, w) patch grid
    at t = 0, for the permuted channels (module docstring)."""
    h, w = size
    s = 2 * ((head_dim // 3) // 2)
    inv = 1.0 / theta ** (torch.arange(0, s, 2, dtype=torch.float32, device=device) / s)          # [s/2]
    rows = torch.arange(h, dtype=torch.float32, device=device).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.float32, device=device).repeat(h)
    half = torch.cat([torch.zeros(h * w, s // 2, device=device), rows[:, None] * inv, cols[:, None] * inv,
                      torch.zeros(h * w, head_dim // 2 - 3 * s // 2, device=device)], dim=-1)   # [n, D/2]
    angles = torch.cat([half, half], dim=-1)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class MiniMaxVitEncoder(NativeVit):
    """MiniMax-M3 ViT: images -> patch features ``[b, gh, gw, embed_dim]`` (see the module doc)."""

    def __init__(self, img_size: int = 448, patch_size: int = 14, temporal_patch_size: int = 2, in_chans: int = 3,
                 embed_dim: int = 1280, depth: int = 32, num_heads: int = 16, mlp_hidden_dim: int = 5120,
                 rope_temperature: float = 10000.0, norm_eps: float = 1e-5, drop_path_rate: float = 0.0,
                 device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.init_common(embed_dim, num_heads, depth, patch_size, rope_temperature, head_multiple=2)
        self.patch_size, self.img_size = patch_size, img_size
        norm_layer = partial(LayerNorm, eps=norm_eps)
        # the released Conv3d weight [d, C, T, p, p]; an image's T frames are identical
        self.patch_weight = nn.Parameter(torch.empty(embed_dim, in_chans, temporal_patch_size, patch_size,
                                                     patch_size, **dd))
        self.norm_pre = norm_layer(embed_dim, **dd)
        dpr = calculate_drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.ModuleList([
            EvaBlock(dim=embed_dim, num_heads=num_heads, qkv_bias=True, qkv_fused=True,
                     mlp_ratio=mlp_ratio_for(embed_dim, mlp_hidden_dim), num_prefix_tokens=0, attn_type="rope",
                     rotate_half=True, drop_path=dpr[i], act_layer=nn.GELU, norm_layer=norm_layer, **dd)
            for i in range(depth)])
        self.norm = nn.Identity()  # transformers' tower returns the last block's output
        trunc_normal_(self.patch_weight, std=0.02)
        self.init_linears()

    def _embed(self, x: torch.Tensor):
        """images [b, 3, H, W] -> (tokens [b, gh*gw, d], rope [gh*gw, 2*head_dim], (gh, gw))."""
        x = F.conv2d(x, self.patch_weight.sum(2), stride=self.patch_size)               # [b, d, gh, gw]
        b, d, gh, gw = x.shape
        x = self.norm_pre(x.flatten(2).transpose(1, 2))
        return x, thw_rope((gh, gw), self.head_dim, self.rope_temperature, device=x.device), (gh, gw)


default_cfgs = generate_default_cfgs({"minimax_m3_vit_enc": pretrained_cfg(448, CLIP_MEAN, CLIP_STD,
                                                                            first_conv="patch_weight")})


@register_model
def minimax_m3_vit_enc(pretrained: bool = False, **kwargs) -> MiniMaxVitEncoder:
    """MiniMax-M3's ViT at its released size (32 blocks, width 1280, 16 heads, MLP 5120, patch 14,
    2 frames); ``kwargs`` resize it (HF ``minimax_m3_vl_vision`` configs: megamoe.vision.hf_minimax)."""
    args = dict(embed_dim=1280, depth=32, num_heads=16, mlp_hidden_dim=5120, patch_size=14, temporal_patch_size=2)
    return build_model_with_cfg(MiniMaxVitEncoder, "minimax_m3_vit_enc", pretrained, kwargs_filter=("num_classes",),
                                feature_cfg=dict(feature_cls="getter"), **dict(args, **kwargs))
