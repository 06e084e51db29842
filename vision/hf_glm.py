"""HF GLM-5 vision towers (``glm5_next_vision``) in megamoe's timm-style ``glm5_vit_enc`` with the
``glm_merger`` projector.

``glm_vision_config(hf_config)`` gives the ``VisionConfig`` sized to the HF vision config; its
inverse ``glm_vision_to_hf``. GLM's processor lays out ``pixel_values`` as Qwen-VL's (patches
grouped by merge blocks, each frame twice): ``megamoe.vision.hf_qwen.images_to_pixel_values``
and ``pixel_values_to_images`` apply. Images only (the Conv3d patch embedding folds over two
identical frames).
"""
from __future__ import annotations

from megamoe.core.config import ImageBoundsConfig, VisionConfig
from megamoe.core.errors import ConfigError


def _get(cfg, key, default=None):
    value = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
    return default if value is None else value


def _check(vc, text_hidden: int | None) -> None:
    for key, want in (("hidden_act", "silu"), ("in_channels", 3)):
        if _get(vc, key, want) != want:
            raise ConfigError(f"HF vision_config.{key}={_get(vc, key)!r} is invalid: GLM-5's tower uses {want!r}")
    rope = _get(vc, "rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"HF vision_config.rope_parameters.rope_type={rope['rope_type']!r} is invalid: allowed axial")
    out = _get(vc, "out_hidden_size", 1536)
    if text_hidden is not None and out != text_hidden:
        raise ConfigError(f"HF vision_config.out_hidden_size={out} must equal the text hidden_size={text_hidden}")
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(_get(vc, key), (list, tuple)):
            raise ConfigError(f"HF vision_config.{key}={_get(vc, key)} is invalid: megamoe takes one int")


def glm_vision_config(hf_config, **overrides) -> VisionConfig:
    """VisionConfig for the tower of an HF ``glm5_next`` config (object or dict with ``vision_config``)."""
    vc = _get(hf_config, "vision_config")
    if vc is None:
        raise ConfigError("HF config has no vision_config: not a GLM-5 vision-language checkpoint")
    text = _get(hf_config, "text_config") or {}
    _check(vc, _get(text, "hidden_size"))
    rope = _get(vc, "rope_parameters") or {}
    patch, merge, limit = _get(vc, "patch_size", 14), _get(vc, "spatial_merge_size", 2), _get(vc, "swiglu_limit", 10.0)
    eps = float(_get(vc, "rms_norm_eps", 1e-5))
    args = dict(embed_dim=_get(vc, "hidden_size", 1024), depth=_get(vc, "depth", 24), num_heads=_get(vc, "num_heads", 16),
                mlp_hidden_dim=_get(vc, "intermediate_size", 4096), patch_size=patch, swiglu_limit=float(limit),
                norm_eps=eps, bias=bool(_get(vc, "attention_bias", True)),
                rope_temperature=float(rope.get("rope_theta", 10000.0)), img_size=patch * merge * 2)
    fields = dict(encoder="glm5_vit_enc", encoder_args=args, projector="glm_merger", merge_size=merge,
                  projector_hidden=_get(vc, "projection_intermediate_size", 10240), projector_swiglu_limit=float(limit),
                  projector_norm_eps=1e-5,  # the merger's LayerNorm: torch's default, whatever rms_norm_eps
                  image_token_id=int(_get(hf_config, "image_token_id", -1)), bounds=ImageBoundsConfig(resize="dynamic"))
    fields.update(overrides)
    return VisionConfig(**fields)


def glm_vision_to_hf(v: VisionConfig, out_hidden: int, original: dict | None) -> dict:
    """HF ``vision_config`` of a glm5_vit_enc tower with a glm_merger (the original's other keys kept)."""
    a = v.encoder_args
    out = dict(original or {})
    out.update(model_type="glm5_next_vision", hidden_size=a.get("embed_dim", 1024), depth=a.get("depth", 24),
               num_heads=a.get("num_heads", 16), intermediate_size=a.get("mlp_hidden_dim", 4096),
               patch_size=a.get("patch_size", 14), spatial_merge_size=v.merge_size, out_hidden_size=out_hidden,
               projection_intermediate_size=v.projector_hidden, swiglu_limit=a.get("swiglu_limit", 10.0),
               rms_norm_eps=a.get("norm_eps", 1e-5), attention_bias=a.get("bias", True), hidden_act="silu",
               rope_parameters={"rope_type": "axial", "rope_theta": a.get("rope_temperature", 10000.0)})
    out.setdefault("temporal_patch_size", 2)
    return out
