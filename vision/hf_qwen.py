"""HF Qwen3.5 / Qwen3-VL vision towers in timm's ``qwen3_vit``, and HF ``pixel_values`` <-> images.

``qwen_vision_config(hf_config)`` gives the ``VisionConfig`` that builds timm's
``qwen3_vit_*_enc`` sized to the HF vision config, reads the checkpoint's ``model.visual.*``
tensors through timm's ``checkpoint_filter_fn_encoder`` (strict) and moves the HF merger into
megamoe's ``PatchMerger``. timm folds the Conv3d patch embedding (two identical frames for an
image) into a Conv2d, so images are covered; video with distinct frames is not.

HF's processor flattens an image into ``pixel_values [gh*gw, C*T*p*p]`` (patches grouped by
k x k merge blocks, each frame duplicated T times) with ``grid_thw = (1, gh, gw)``.
``pixel_values_to_images`` inverts that exactly; ``images_to_pixel_values`` is the forward
direction (for feeding HF reference models).
"""
from __future__ import annotations

import math

import torch

from megamoe.core.config import ImageBoundsConfig, VisionConfig
from megamoe.core.errors import ConfigError

# timm variant per encoder width (the name only picks timm's pretrained defaults: mean/std 0.5)
VARIANTS = {768: "qwen3_vit_88m_enc", 1024: "qwen3_vit_306m_enc", 1152: "qwen3_vit_416m_enc"}


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def qwen_vision_config(hf_config, *, weights: str | None = None, **overrides) -> VisionConfig:
    """VisionConfig for the vision tower of an HF ``qwen3_5_moe`` / ``qwen3_5`` / ``qwen3_vl`` config
    (object or dict with ``vision_config``); ``overrides`` set other VisionConfig fields."""
    vc = _get(hf_config, "vision_config")
    if vc is None:
        raise ConfigError("HF config has no vision_config: not a Qwen vision-language checkpoint")
    act = _get(vc, "hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"HF vision_config.hidden_act={act!r} is invalid: timm's qwen3_vit uses gelu_pytorch_tanh")
    if _get(vc, "in_channels", 3) != 3:
        raise ConfigError(f"HF vision_config.in_channels={_get(vc, 'in_channels')} is invalid: images have 3 channels")
    width, patch = _get(vc, "hidden_size"), _get(vc, "patch_size")
    merge, grid = _get(vc, "spatial_merge_size", 2), math.isqrt(_get(vc, "num_position_embeddings"))
    if grid * grid != _get(vc, "num_position_embeddings"):
        raise ConfigError("HF vision_config.num_position_embeddings must be a square (timm resamples a square grid)")
    rope = _get(vc, "rope_parameters") or {}
    args = dict(embed_dim=width, depth=_get(vc, "depth"), num_heads=_get(vc, "num_heads"),
                mlp_ratio=_get(vc, "intermediate_size") / width, patch_size=patch, merge_size=merge,
                pos_embed_grid_size=grid, out_features=_get(vc, "out_hidden_size"),
                rope_temperature=float(rope.get("rope_theta", 10000.0)), img_size=patch * merge * 2)
    fields = dict(encoder=VARIANTS.get(width, "qwen3_vit_88m_enc"), encoder_args=args, weights=weights,
                  weights_prefix="model.visual." if weights else None, projector="merger", merge_size=merge,
                  image_token_id=int(_get(hf_config, "image_token_id", -1)),
                  bounds=ImageBoundsConfig(resize="dynamic"))
    fields.update(overrides)
    return VisionConfig(**fields)


def images_to_pixel_values(images: torch.Tensor, patch_size: int, merge_size: int = 2,
                           temporal_patch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, C, H, W] -> (pixel_values [B*gh*gw, C*T*p*p], grid_thw [B, 3]) in HF's layout."""
    b, c, h, w = images.shape
    p, k = patch_size, merge_size
    gh, gw = h // p, w // p
    if h % (p * k) or w % (p * k):
        raise ValueError(f"image {h}x{w} is not a multiple of patch_size*merge_size={p * k}")
    x = images.reshape(b, c, gh // k, k, p, gw // k, k, p)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [B, gh/k, gw/k, k, k, C, p, p]
    x = x.unsqueeze(6).expand(*x.shape[:6], temporal_patch_size, p, p)  # [.., C, T, p, p]
    pixel_values = x.reshape(b * gh * gw, c * temporal_patch_size * p * p)
    grid = torch.tensor([[1, gh, gw]] * b, dtype=torch.long)
    return pixel_values, grid


def pixel_values_to_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch_size: int,
                           merge_size: int = 2, temporal_patch_size: int = 2, channels: int = 3,
                           atol: float = 0.0) -> list[torch.Tensor]:
    """HF ``pixel_values`` + ``image_grid_thw`` -> one [C, H, W] tensor per image (exact inverse of
    the processor's patch flattening). Frames must be identical (images, not video)."""
    p, k, T = patch_size, merge_size, temporal_patch_size
    width = channels * T * p * p
    if pixel_values.dim() != 2 or pixel_values.size(1) != width:
        raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}, expected [patches, {width}] "
                         f"(channels*temporal_patch_size*patch_size^2)")
    sizes = [int(t * h * w) for t, h, w in grid_thw.tolist()]
    if sum(sizes) != pixel_values.size(0):
        raise ValueError(f"pixel_values has {pixel_values.size(0)} patches but image_grid_thw describes {sum(sizes)}")
    images = []
    for i, (rows, (t, gh, gw)) in enumerate(zip(pixel_values.split(sizes), grid_thw.tolist())):
        if t != 1:
            raise ValueError(f"image_grid_thw[{i}] has t={t}: video with several frames is not supported")
        x = rows.reshape(gh // k, gw // k, k, k, channels, T, p, p)
        if (x - x[:, :, :, :, :, :1]).abs().max() > atol:
            raise ValueError(f"image {i}: its {T} temporal frames differ (video); only images are supported")
        x = x[:, :, :, :, :, 0].permute(4, 0, 2, 5, 1, 3, 6)  # [C, gh/k, k, p, gw/k, k, p]
        images.append(x.reshape(channels, gh * p, gw * p))
    return images
