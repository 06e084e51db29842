"""Qwen3.5-MoE: the vision-language model (``qwen3_5_moe``, Qwen3_5MoeForConditionalGeneration)
and its text-only form (``qwen3_5_moe_text``, Qwen3_5MoeForCausalLM).

Text backbone as Qwen3-Next (qwen3_next.py) except: every layer is MoE, GDN's projections are
separate (``in_proj_qkv``, ``_z``, ``_b``, ``_a``), and attention uses interleaved M-RoPE
(``rope_parameters.mrope_section``, HF's default [11, 11, 10] in the VLM). The VLM nests the text
under ``text_config`` / ``model.language_model.`` and the vision tower under ``vision_config`` /
``model.visual.``: timm's ``qwen3_vit`` encoder (megamoe.vision.hf_qwen) plus megamoe's
PatchMerger. The vision rules mirror timm's ``checkpoint_filter_fn_encoder``:

    model.visual.patch_embed.proj.weight [D, C, T, p, p]  <-> vision.encoder.model.patch_embed.proj.weight
        [D, C, p, p] (Conv3d over T identical frames = Conv2d with the T slices summed; the way back
        spreads the kernel evenly over the T frames: images give the same result, video would not)
    model.visual.pos_embed.weight [N, D]  <-> vision.encoder.model.pos_embed [1, N, D]
    model.visual.blocks.{B}.{norm1,attn.qkv,attn.proj,norm2}.*  <-> vision.encoder.model.blocks.{B}.(same)
    model.visual.blocks.{B}.mlp.linear_fc{1,2}.*  <-> vision.encoder.model.blocks.{B}.mlp.fc{1,2}.*
    model.visual.merger.{norm,linear_fc1,linear_fc2}.*  <-> vision.projector.{norm,fc1,fc2}.*
"""
from __future__ import annotations

import copy

from megamoe.core.config import ModelConfig, VisionConfig
from megamoe.convert.family import Family, hf_get, register
from megamoe.convert.families.common import base_hf_config
from megamoe.convert.families.qwen3_next import check_exportable, hybrid_config, hybrid_rules, hybrid_to_hf
from megamoe.convert.table import Fn, Rule, Same
from megamoe.core.errors import CheckpointError, ConfigError

DEFAULT_MROPE = [11, 11, 10]  # transformers' default for Qwen3.5 when rope_parameters has none


# ---- configs ---------------------------------------------------------------------------------

def text_from_hf(text: dict, model_type: str, mrope_default: list | None = None) -> ModelConfig:
    cfg = hybrid_config(text, model_type, ["e"] * hf_get(text, "num_hidden_layers"))
    cfg.attention.mrope_section = (text.get("rope_parameters") or {}).get("mrope_section", mrope_default)
    return cfg


def text_to_hf(cfg: ModelConfig, out: dict, model_type: str) -> dict:
    check_exportable(cfg, model_type, "e")
    hybrid_to_hf(cfg, out)
    if cfg.attention.mrope_section is not None:
        out["rope_parameters"].update(mrope_section=list(cfg.attention.mrope_section), mrope_interleaved=True)
    return out


def text_config_from_hf(hf: dict) -> ModelConfig:
    return text_from_hf(hf, "qwen3_5_moe_text")


def text_config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out = base_hf_config(cfg, original, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
    return text_to_hf(cfg, out, "qwen3_5_moe_text")


def vlm_config_from_hf(hf: dict) -> ModelConfig:
    from megamoe.vision.hf_qwen import qwen_vision_config

    text = dict(hf_get(hf, "text_config"))
    for key in ("tie_word_embeddings", "dtype"):  # the top-level values are the ones transformers uses
        if hf.get(key) is not None:
            text[key] = hf[key]
    cfg = text_from_hf(text, "qwen3_5_moe", DEFAULT_MROPE)
    try:
        cfg.vision = qwen_vision_config(hf)
    except ConfigError as e:
        raise CheckpointError(f"config.json: {e}") from None
    return cfg


def vision_to_hf(v: VisionConfig, out_hidden: int, original: dict | None) -> dict:
    """HF vision_config of a timm qwen3_vit encoder with a PatchMerger (the inverse of
    megamoe.vision.hf_qwen.qwen_vision_config)."""
    if not v.encoder.startswith("qwen3_vit_") or v.projector != "merger":
        raise CheckpointError(f"export to qwen3_5_moe: model.vision must be a timm qwen3_vit_* encoder with "
                              f"projector=merger (got encoder={v.encoder!r}, projector={v.projector!r})")
    a = v.encoder_args
    for key in ("embed_dim", "depth", "num_heads", "mlp_ratio", "patch_size", "pos_embed_grid_size"):
        if key not in a:
            raise CheckpointError(f"export to qwen3_5_moe: model.vision.encoder_args.{key} is not set")
    out = copy.deepcopy(original) if original else {"hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
                                                    "temporal_patch_size": 2}
    out.update(model_type="qwen3_5_moe_vision", depth=a["depth"], hidden_size=a["embed_dim"], num_heads=a["num_heads"],
               intermediate_size=round(a["mlp_ratio"] * a["embed_dim"]), patch_size=a["patch_size"],
               spatial_merge_size=v.merge_size, out_hidden_size=out_hidden,
               num_position_embeddings=a["pos_embed_grid_size"] ** 2)
    out.setdefault("rope_parameters", {"rope_type": "axial"})["rope_theta"] = a.get("rope_temperature", 10000.0)
    return out


def vlm_config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    if cfg.vision is None:
        raise CheckpointError("export to qwen3_5_moe: model.vision is not set (use qwen3_5_moe_text for a text model)")
    out = base_hf_config(cfg, original, "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")
    text = copy.deepcopy(out.get("text_config") or {})
    text["model_type"] = "qwen3_5_moe_text"
    out["text_config"] = text_to_hf(cfg, text, "qwen3_5_moe")
    out["vision_config"] = vision_to_hf(cfg.vision, cfg.hidden_size, out.get("vision_config"))
    out.update(image_token_id=cfg.vision.image_token_id, tie_word_embeddings=cfg.tie_embeddings)
    return out


# ---- mapping tables --------------------------------------------------------------------------

BLOCK_PARTS = {"norm1": "norm1", "attn.qkv": "attn.qkv", "attn.proj": "attn.proj", "norm2": "norm2",
               "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}  # timm -> HF, each .weight and .bias
MERGER_PARTS = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}  # PatchMerger -> HF merger


def _frames(ctx) -> int:
    return int(ctx.hf.get("vision_config", {}).get("temporal_patch_size", 2))


def conv3d_to_2d(t, ctx):
    """[D, C, T, p, p] -> [D, C, p, p], summed exactly (float64) and rounded once, as timm does."""
    w = t[0]
    if w.dim() != 5:
        raise ValueError(f"expected a Conv3d weight [D, C, T, p, p], got {list(w.shape)}")
    return w.double().sum(dim=2).to(w.dtype)


def conv2d_to_3d(w, ctx):
    frames = _frames(ctx)
    return (w / frames).unsqueeze(2).expand(-1, -1, frames, -1, -1)


def vision_rules(cfg: ModelConfig, prefix: str = "model.visual.") -> list[Rule]:
    enc, depth = "vision.encoder.model.", int(cfg.vision.encoder_args.get("depth", 0))
    rules: list[Rule] = [
        Fn(f"{enc}patch_embed.proj.weight", (f"{prefix}patch_embed.proj.weight",), forward=conv3d_to_2d,
           backward=conv2d_to_3d),
        Same(f"{enc}patch_embed.proj.bias", f"{prefix}patch_embed.proj.bias"),
        Fn(f"{enc}pos_embed", (f"{prefix}pos_embed.weight",), forward=lambda t, ctx: t[0].unsqueeze(0),
           backward=lambda w, ctx: w.squeeze(0)),
    ]
    for b in range(depth):
        rules += [Same(f"{enc}blocks.{b}.{ours}.{p}", f"{prefix}blocks.{b}.{theirs}.{p}")
                  for ours, theirs in BLOCK_PARTS.items() for p in ("weight", "bias")]
    rules += [Same(f"vision.projector.{ours}.{p}", f"{prefix}merger.{theirs}.{p}")
              for ours, theirs in MERGER_PARTS.items() for p in ("weight", "bias")]
    return rules


def text_rules(cfg: ModelConfig, hf: dict):
    return hybrid_rules(cfg, "model.", fused_gdn=False)


def vlm_rules(cfg: ModelConfig, hf: dict):
    return [*hybrid_rules(cfg, "model.language_model.", fused_gdn=False), *vision_rules(cfg)]


QWEN3_5_MOE_TEXT = register(Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", text_config_from_hf,
                                   text_config_to_hf, text_rules, notes="the text model of qwen3_5_moe"))
QWEN3_5_MOE = register(Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", vlm_config_from_hf,
                              vlm_config_to_hf, vlm_rules, notes="Gated DeltaNet + gated M-RoPE attention + MoE, "
                              "and the vision tower (timm qwen3_vit; images, not video)"))
