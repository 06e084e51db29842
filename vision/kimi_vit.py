"""Kimi-K2.5's vision tower (MoonViT, transformers' ``kimi_k25_vision``) as a timm encoder.

timm has no MoonViT, so this is one written in timm's style and registered in timm's model
registry (``timm.create_model("kimi_k25_vit_enc", embed_dim=..., ...)``), which is how
``megamoe.vision.TimmEncoder`` builds every encoder. The blocks are timm's ``EvaBlock``
(pre-LayerNorm eps 1e-5, ``AttentionRope`` with a fused biased ``qkv`` (MoonViT's ``wqkv``), rotate-half
2D RoPE, GELU-tanh ``Mlp``), so tensor parallelism (``megamoe.vision.tensor_parallel``) splits
them as it splits any timm ViT::

    images [b, 3, H, W] -> Conv2d patch 14 -> [b, gh, gw, d]
      + learned grid pos_embed [Gh, Gw, d] resampled bicubic (align_corners=False) to (gh, gw)
      -> depth x EvaBlock(rope = axial_rope(..., layout="wh_interleaved"))
      -> LayerNorm (eps 1e-5) -> features [b, gh, gw, d]   (output_fmt NHWC)

MoonViT also adds a sinusoidal time embedding per video frame; its row for a single frame is
zero, so images (the only input here) see none. Parameters (d, depth L, MLP width f, patch p,
grid G): 3p²d + d + Gh·Gw·d + L(4d² + 4d + 2df + f + d + 4d) + 2d.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from timm.layers import LayerNorm, PatchEmbed, calculate_drop_path_rates, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.eva import EvaBlock

from megamoe.vision.native_vit import NativeVit, pretrained_cfg
from megamoe.vision.pos_embed import axial_rope, resample_grid

__all__ = ["KimiVitEncoder"]


def mlp_ratio_for(dim: int, hidden: int) -> float:
    """The ratio EvaBlock turns back into ``int(dim * ratio) == hidden`` exactly (a plain
    hidden / dim can land a float ulp below and lose a channel)."""
    return (hidden + 0.5) / dim


class KimiVitEncoder(NativeVit):
    """MoonViT encoder: images -> patch features ``[b, gh, gw, embed_dim]`` (see the module doc)."""

    def __init__(self, img_size: int = 448, patch_size: int = 14, in_chans: int = 3, embed_dim: int = 1152,
                 depth: int = 27, num_heads: int = 16, mlp_hidden_dim: int = 4304, pos_embed_grid: tuple = (64, 64),
                 rope_temperature: float = 10000.0, norm_eps: float = 1e-5, drop_path_rate: float = 0.0,
                 device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.init_common(embed_dim, num_heads, depth, patch_size, rope_temperature, head_multiple=4)
        norm_layer = partial(LayerNorm, eps=norm_eps)
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                                      bias=True, strict_img_size=False, output_fmt="NHWC", **dd)
        self.pos_embed = nn.Parameter(torch.empty(*pos_embed_grid, embed_dim, **dd))  # [Gh, Gw, d] as MoonViT
        dpr = calculate_drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.ModuleList([
            EvaBlock(dim=embed_dim, num_heads=num_heads, qkv_bias=True, qkv_fused=True,
                     mlp_ratio=mlp_ratio_for(embed_dim, mlp_hidden_dim), num_prefix_tokens=0, attn_type="rope",
                     rotate_half=True, drop_path=dpr[i], act_layer=partial(nn.GELU, approximate="tanh"),
                     norm_layer=norm_layer, **dd)
            for i in range(depth)])
        self.norm = norm_layer(embed_dim, **dd)
        trunc_normal_(self.pos_embed, std=0.02)
        self.init_linears()

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {"pos_embed"}

    def _embed(self, x: torch.Tensor):
        """images [b, 3, H, W] -> (tokens [b, gh*gw, d], rope [gh*gw, 2*head_dim], (gh, gw))."""
        x = self.patch_embed(x)
        b, gh, gw, d = x.shape
        x = x.reshape(b, gh * gw, d) + resample_grid(self.pos_embed, (gh, gw)).to(x.dtype)
        rope = axial_rope((gh, gw), self.head_dim, self.rope_temperature, "wh_interleaved", device=x.device)
        return x, rope, (gh, gw)


default_cfgs = generate_default_cfgs({"kimi_k25_vit_enc": pretrained_cfg(448)})


@register_model
def kimi_k25_vit_enc(pretrained: bool = False, **kwargs) -> KimiVitEncoder:
    """Kimi-K2.5's MoonViT at its released size (27 blocks, width 1152, 16 heads, MLP 4304, 64x64 grid);
    ``kwargs`` resize it (HF ``kimi_k25_vision`` configs: megamoe.vision.hf_kimi)."""
    args = dict(embed_dim=1152, depth=27, num_heads=16, mlp_hidden_dim=4304, pos_embed_grid=(64, 64))
    return build_model_with_cfg(KimiVitEncoder, "kimi_k25_vit_enc", pretrained, kwargs_filter=("num_classes",),
                                feature_cfg=dict(feature_cls="getter"), **dict(args, **kwargs))
