"""GLM-5's vision tower (transformers' ``glm5_next_vision``) as a timm encoder.

timm has no GLM ViT and its EVA blocks do not fit exactly (the gated MLP clamps its inputs), so
this is a tower written in timm's style from timm's parts, registered in timm's registry as
``glm5_vit_enc``. Each block is RMSNorm -> timm ``AttentionRope`` (fused biased ``qkv``,
per-head RMSNorm on q and k, rotate-half 2D RoPE in Qwen's row-block/column-block layout) ->
RMSNorm -> ``ClampedSwiGLU`` (timm's ``SwiGLU`` with gate <= limit and |up| <= limit), so tensor
parallelism splits it as any timm ViT::

    images [b, 3, H, W] -> Conv2d patch p (HF's Conv3d over two identical frames, folded)
      -> depth x block(rope = axial_rope((gh, gw), head_dim, theta, "hw"))
      -> RMSNorm -> features [b, gh, gw, d]   (output_fmt NHWC; no learned position table)

The merge into language-model tokens (a k x k strided conv, then a clamped SwiGLU) is
``megamoe.vision.projector.GlmMerger``. Parameters (d, depth L, MLP width f, patch p, biased):
3p²d + d + L(2d + 4d² + 4d + 2·head_dim + 3df + 2f + d) + d.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from timm.layers import PatchEmbed, RmsNorm, SwiGLU
from timm.layers.attention import AttentionRope
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from megamoe.vision.native_vit import CLIP_MEAN, CLIP_STD, NativeVit, pretrained_cfg
from megamoe.vision.pos_embed import axial_rope

__all__ = ["ClampedSwiGLU", "GlmVitEncoder"]


class ClampedSwiGLU(SwiGLU):
    """timm's SwiGLU (``fc1_g`` gate, ``fc1_x`` up, ``fc2`` down) with GLM's clamp:
    fc2(silu(min(gate, limit)) * clamp(up, -limit, limit))."""

    def __init__(self, in_features: int, hidden_features: int, limit: float, bias: bool = True, **kw):
        super().__init__(in_features, hidden_features, act_layer=nn.SiLU, bias=bias, **kw)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.fc1_g(x).clamp(max=self.limit)
        up = self.fc1_x(x).clamp(-self.limit, self.limit)
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(gate) * up))))


class GlmVitBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_hidden_dim: int, swiglu_limit: float, norm_eps: float,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        norm = partial(RmsNorm, eps=norm_eps)
        self.norm1 = norm(dim, **dd)
        self.attn = AttentionRope(dim, num_heads=num_heads, qkv_bias=bias, qkv_fused=True, num_prefix_tokens=0,
                                  norm_layer=norm, qk_norm=True, proj_bias=bias, rotate_half=True, **dd)
        self.norm2 = norm(dim, **dd)
        self.mlp = ClampedSwiGLU(dim, mlp_hidden_dim, swiglu_limit, bias=bias, **dd)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope=rope)
        return x + self.mlp(self.norm2(x))


class GlmVitEncoder(NativeVit):
    """GLM-5 vision encoder: images -> patch features ``[b, gh, gw, embed_dim]`` (module doc)."""

    def __init__(self, img_size: int = 336, patch_size: int = 14, in_chans: int = 3, embed_dim: int = 1024,
                 depth: int = 24, num_heads: int = 16, mlp_hidden_dim: int = 4096, swiglu_limit: float = 10.0,
                 norm_eps: float = 1e-5, bias: bool = True, rope_temperature: float = 10000.0, device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.init_common(embed_dim, num_heads, depth, patch_size, rope_temperature, head_multiple=4)
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                                      bias=True, strict_img_size=False, output_fmt="NHWC", **dd)
        self.blocks = nn.ModuleList([GlmVitBlock(embed_dim, num_heads, mlp_hidden_dim, swiglu_limit, norm_eps, bias, **dd)
                                     for _ in range(depth)])
        self.norm = RmsNorm(embed_dim, eps=norm_eps, **dd)
        self.init_linears()

    def _embed(self, x: torch.Tensor):
        """images [b, 3, H, W] -> (tokens [b, gh*gw, d], rope [gh*gw, 2*head_dim], (gh, gw))."""
        x = self.patch_embed(x)
        b, gh, gw, d = x.shape
        rope = axial_rope((gh, gw), self.head_dim, self.rope_temperature, "hw", device=x.device)
        return x.reshape(b, gh * gw, d), rope, (gh, gw)


default_cfgs = generate_default_cfgs({"glm5_vit_enc": pretrained_cfg(336, CLIP_MEAN, CLIP_STD)})


@register_model
def glm5_vit_enc(pretrained: bool = False, **kwargs) -> GlmVitEncoder:
    """GLM-5's vision encoder at transformers' default size (24 blocks, width 1024, 16 heads, MLP
    4096, patch 14); ``kwargs`` resize it (HF ``glm5_next_vision`` configs: megamoe.vision.hf_glm)."""
    args = dict(embed_dim=1024, depth=24, num_heads=16, mlp_hidden_dim=4096)
    return build_model_with_cfg(GlmVitEncoder, "glm5_vit_enc", pretrained, kwargs_filter=("num_classes",),
                                feature_cfg=dict(feature_cls="getter"), **dict(args, **kwargs))
