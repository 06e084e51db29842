"""HF Kimi-K2.5 vision towers (``kimi_k25_vision``) in megamoe's timm-style MoonViT, and HF
``pixel_values`` <-> images.

``kimi_vision_config(hf_config)`` gives the ``VisionConfig`` that builds ``kimi_k25_vit_enc``
(megamoe.vision.kimi_vit) sized to the HF vision config, with megamoe's ``PatchMerger`` as the
projector (HF's ``mm_projector``: LayerNorm per patch, 2x2 row-major merge, Linear-GELU-Linear).
Both spellings of the vision config are read: transformers' (``hidden_size``, ``pos_emb_height``,
``num_hidden_layers``; ``projection_layer_norm_eps`` at the top) and the hub's remote-code one
(``vt_hidden_size``, ``init_pos_emb_height``, ``vt_num_hidden_layers``, ``projector_ln_eps``).

Kimi's processor patchifies each image in raster order: ``pixel_values [gh*gw, 3, p, p]`` with
``grid_thw = (1, gh, gw)``; ``pixel_values_to_images`` inverts that exactly.
"""
from __future__ import annotations

import torch

from megamoe.core.config import ImageBoundsConfig, VisionConfig
from megamoe.core.errors import ConfigError

# field -> (transformers' name, hub remote-code name, default)
FIELDS = {"width": ("hidden_size", "vt_hidden_size", 1152), "depth": ("num_hidden_layers", "vt_num_hidden_layers", 27),
          "heads": ("num_attention_heads", "vt_num_attention_heads", 16),
          "mlp": ("intermediate_size", "vt_intermediate_size", 4304),
          "grid_h": ("pos_emb_height", "init_pos_emb_height", 64), "grid_w": ("pos_emb_width", "init_pos_emb_width", 64)}


def _get(cfg, key, default=None):
    value = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
    return default if value is None else value


def vision_field(vc, field: str):
    ours, hub, default = FIELDS[field]
    return _get(vc, ours, _get(vc, hub, default))


def _check(vc, hf_config) -> None:
    act = _get(vc, "hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"HF vision_config.hidden_act={act!r} is invalid: MoonViT uses gelu_pytorch_tanh")
    merge = list(_get(vc, "merge_kernel_size", (2, 2)))
    if merge[0] != merge[1]:
        raise ConfigError(f"HF vision_config.merge_kernel_size={merge} is invalid: megamoe merges square blocks")
    rope = _get(vc, "rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"HF vision_config.rope_parameters.rope_type={rope['rope_type']!r} is invalid: allowed axial")
    proj = _get(hf_config, "projection_hidden_size") or _get(vc, "mm_hidden_size")
    if proj is not None and proj != vision_field(vc, "width"):
        raise ConfigError(f"HF projection_hidden_size={proj} must equal the vision width "
                          f"{vision_field(vc, 'width')} (the projector normalises each patch)")


def kimi_vision_config(hf_config, **overrides) -> VisionConfig:
    """VisionConfig for the tower of an HF ``kimi_k25`` config (object or dict with ``vision_config``)."""
    vc = _get(hf_config, "vision_config")
    if vc is None:
        raise ConfigError("HF config has no vision_config: not a Kimi-K2.5 vision-language checkpoint")
    _check(vc, hf_config)
    rope = _get(vc, "rope_parameters") or {}
    patch, merge = _get(vc, "patch_size", 14), list(_get(vc, "merge_kernel_size", (2, 2)))[0]
    args = dict(embed_dim=vision_field(vc, "width"), depth=vision_field(vc, "depth"),
                num_heads=vision_field(vc, "heads"), mlp_hidden_dim=vision_field(vc, "mlp"), patch_size=patch,
                pos_embed_grid=(vision_field(vc, "grid_h"), vision_field(vc, "grid_w")),
                rope_temperature=float(rope.get("rope_theta", 10000.0)), img_size=patch * merge * 2)
    eps = _get(hf_config, "projection_layer_norm_eps", _get(vc, "projector_ln_eps", 1e-5))
    token = _get(hf_config, "image_token_id", _get(hf_config, "media_placeholder_token_id", -1))
    fields = dict(encoder="kimi_k25_vit_enc", encoder_args=args, projector="merger", merge_size=merge,
                  projector_norm_eps=float(eps), image_token_id=int(token), bounds=ImageBoundsConfig(resize="dynamic"))
    fields.update(overrides)
    return VisionConfig(**fields)


def kimi_vision_to_hf(v: VisionConfig, original: dict | None) -> dict:
    """HF ``vision_config`` (transformers' spelling) of a kimi_k25_vit_enc tower (the inverse of
    ``kimi_vision_config``); the original's other keys are kept."""
    a = v.encoder_args
    out = {k: val for k, val in (original or {}).items()
           if k not in {hub for _, hub, _ in FIELDS.values()}}  # one spelling only, transformers'
    grid = a.get("pos_embed_grid", (64, 64))
    out.update(model_type="kimi_k25_vision", hidden_size=a.get("embed_dim", 1152), num_hidden_layers=a.get("depth", 27),
               num_attention_heads=a.get("num_heads", 16), intermediate_size=a.get("mlp_hidden_dim", 4304),
               patch_size=a.get("patch_size", 14), pos_emb_height=grid[0], pos_emb_width=grid[1],
               merge_kernel_size=[v.merge_size, v.merge_size], hidden_act="gelu_pytorch_tanh",
               rope_parameters={"rope_type": "axial", "rope_theta": a.get("rope_temperature", 10000.0)})
    return out


def images_to_pixel_values(images: torch.Tensor, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, C, H, W] -> (pixel_values [B*gh*gw, C, p, p] raster order, grid_thw [B, 3]) as Kimi's processor."""
    b, c, h, w = images.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image {h}x{w} is not a multiple of patch_size={p}")
    x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # [B, gh, gw, C, p, p]
    grid = torch.tensor([[1, h // p, w // p]] * b, dtype=torch.long)
    return x.reshape(b * (h // p) * (w // p), c, p, p), grid


def pixel_values_to_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """Kimi ``pixel_values [N, C, p, p]`` + ``image_grid_thw`` -> one [C, H, W] tensor per image."""
    if pixel_values.dim() != 4 or pixel_values.size(-1) != pixel_values.size(-2):
        raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}, expected [patches, C, p, p]")
    sizes = [int(t * h * w) for t, h, w in grid_thw.tolist()]
    if sum(sizes) != pixel_values.size(0):
        raise ValueError(f"pixel_values has {pixel_values.size(0)} patches but image_grid_thw describes {sum(sizes)}")
    c, p = pixel_values.shape[1], pixel_values.shape[-1]
    images = []
    for i, (rows, (t, gh, gw)) in enumerate(zip(pixel_values.split(sizes), grid_thw.tolist())):
        if t != 1:
            raise ValueError(f"image_grid_thw[{i}] has t={t}: video with several frames is not supported")
        images.append(rows.reshape(gh, gw, c, p, p).permute(2, 0, 3, 1, 4).reshape(c, gh * p, gw * p))
    return images
