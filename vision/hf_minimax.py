"""HF MiniMax-M3 vision towers (``minimax_m3_vl_vision``) in megamoe's timm-style
``minimax_m3_vit_enc`` (megamoe.vision.minimax_vit), with the ``mlp_merger`` projector
(transformers' ``MiniMaxM3VLMultiModalProjector``: a GELU MLP per patch into the LM width,
2x2 merge, a GELU MLP merging the four).

The processor is Qwen2-VL's (``pixel_values [gh*gw, C*T*p*p]``, patches grouped by merge
blocks, frames duplicated T times): ``megamoe.vision.hf_qwen``'s ``images_to_pixel_values`` /
``pixel_values_to_images`` convert both ways.
"""
from __future__ import annotations

from megamoe.core.config import ImageBoundsConfig, VisionConfig
from megamoe.core.errors import ConfigError

ENCODER = "minimax_m3_vit_enc"
DEFAULTS = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
            "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "layer_norm_eps": 1e-5}


def _get(cfg, key, default=None):
    value = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
    return default if value is None else value


def minimax_vision_config(hf_config, **overrides) -> VisionConfig:
    """VisionConfig for the tower of an HF ``minimax_m3_vl`` config (object or dict)."""
    vc = _get(hf_config, "vision_config")
    if vc is None:
        raise ConfigError("HF config has no vision_config: not a MiniMax-M3-VL checkpoint")
    v = {k: _get(vc, k, d) for k, d in DEFAULTS.items()}
    for key, want in (("hidden_act", "gelu"), ("num_channels", 3)):
        if _get(vc, key, want) != want:
            raise ConfigError(f"HF vision_config.{key}={_get(vc, key)!r} is invalid: MiniMax-M3's tower has {want!r}")
    rope = _get(vc, "rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"HF vision_config.rope_parameters.rope_type={rope['rope_type']!r} is invalid: allowed axial")
    text = _get(hf_config, "text_config") or {}
    args = dict(embed_dim=v["hidden_size"], depth=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
                mlp_hidden_dim=v["intermediate_size"], patch_size=v["patch_size"],
                temporal_patch_size=v["temporal_patch_size"], norm_eps=float(v["layer_norm_eps"]),
                rope_temperature=float(rope.get("rope_theta", 10000.0)),
                img_size=v["patch_size"] * v["spatial_merge_size"] * 2)
    fields = dict(encoder=ENCODER, encoder_args=args, projector="mlp_merger", merge_size=v["spatial_merge_size"],
                  projector_hidden=int(_get(hf_config, "projector_hidden_size", _get(text, "hidden_size"))),
                  image_token_id=int(_get(hf_config, "image_token_index", _get(hf_config, "image_token_id", -1))),
                  bounds=ImageBoundsConfig(resize="dynamic"))
    fields.update(overrides)
    return VisionConfig(**fields)


def minimax_vision_to_hf(v: VisionConfig, original: dict | None) -> dict:
    """HF ``vision_config`` of a minimax_m3_vit_enc tower (the inverse of ``minimax_vision_config``);
    the original's other keys are kept."""
    a = v.encoder_args
    out = dict(original or {})
    out.update(model_type="minimax_m3_vl_vision", hidden_size=a.get("embed_dim", 1280),
               intermediate_size=a.get("mlp_hidden_dim", 5120), num_hidden_layers=a.get("depth", 32),
               num_attention_heads=a.get("num_heads", 16), patch_size=a.get("patch_size", 14),
               temporal_patch_size=a.get("temporal_patch_size", 2), spatial_merge_size=v.merge_size,
               layer_norm_eps=a.get("norm_eps", 1e-5), hidden_act="gelu", num_channels=3,
               rope_parameters={"rope_type": "axial", "rope_theta": a.get("rope_temperature", 10000.0)})
    return out
