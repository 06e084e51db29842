"""Qwen3-VL-MoE (``qwen3_vl_moe``, ``Qwen3VLMoeForConditionalGeneration``).

Text (``text_config``, ``model.language_model.``): Qwen3-MoE (GQA with QK-norm, softmax top-k
routed experts, always renormalised, no shared expert; dense layers by ``mlp_only_layers`` /
``decoder_sparse_step``) with interleaved M-RoPE (``rope_parameters.mrope_section``,
transformers' default [24, 20, 20]). Vision (``vision_config``, ``model.visual.``): Qwen3-VL's
ViT as timm's ``qwen3_vit`` + megamoe's PatchMerger, exactly as qwen3_5_moe's tower
(megamoe.vision.hf_qwen, ``qwen3_5_moe.vision_rules``), plus DeepStack: the outputs of blocks
``deepstack_visual_indexes`` each go through their own merger (LayerNorm after the 2x2 merge)
and are added to the hidden states at the image tokens after LM layers 0, 1, 2
(``model.vision.deepstack_layers``, megamoe.model.multimodal)::

    model.visual.deepstack_merger_list.{i}.norm|linear_fc1|linear_fc2 -> vision.deepstack.{i}.norm|fc1|fc2

The routed experts are stacked in both of transformers' layouts under the same names, in
different orientations: the hub's ``mlp.experts.gate_up_proj [E, h, 2F]`` / ``down_proj
[E, F, h]`` (what ``save_pretrained`` writes and exports write) or the in-memory ``[E, 2F, h]``
/ ``[E, h, F]`` (``save_original_format=False``); the shape tells which, except when
h = 2F (gate_up) or h = F (down), where the hub's is assumed.
"""
from __future__ import annotations

import copy

import torch

from megamoe.convert.families import qwen3_moe
from megamoe.convert.families.common import (attention_rules, base_hf_config, dense_mlp_rules, embedding_rules,
                                             norm_rules, text_config)
from megamoe.convert.families.deepseek_v3 import expressible
from megamoe.convert.families.qwen3_5_moe import vision_rules as qwen_vision_rules
from megamoe.convert.families.qwen3_5_moe import vision_to_hf as qwen_vision_to_hf
from megamoe.convert.family import WITH_FP8, Family, register
from megamoe.convert.table import Fn, Rule, Same
from megamoe.core.config import ModelConfig
from megamoe.core.errors import CheckpointError, ConfigError

DEFAULT_MROPE = [24, 20, 20]
TEXT_ONLY_KEYS = ("norm_topk_prob", "use_sliding_window", "sliding_window")  # not fields of the VL text config


# ---- configs ---------------------------------------------------------------------------------

def config_from_hf(hf: dict) -> ModelConfig:
    from megamoe.vision.hf_qwen import qwen_vision_config

    text = {k: v for k, v in text_config(hf).items() if k not in TEXT_ONLY_KEYS}
    for key in ("tie_word_embeddings", "dtype"):  # the top-level values are the ones transformers uses
        if hf.get(key) is not None:
            text[key] = hf[key]
    cfg = qwen3_moe.config_from_hf(text)
    cfg.attention.mrope_section = list((text.get("rope_parameters") or {}).get("mrope_section") or DEFAULT_MROPE)
    if cfg.moe is not None:
        cfg.moe.norm_topk_prob = True  # Qwen3-VL-MoE's router always renormalises the top-k weights
    try:
        deepstack = list((hf.get("vision_config") or {}).get("deepstack_visual_indexes") or [])
        cfg.vision = qwen_vision_config(hf, deepstack_layers=deepstack)
    except ConfigError as e:
        raise CheckpointError(f"config.json: {e}") from None
    return cfg


def _check_text(cfg: ModelConfig) -> None:
    a, kinds = cfg.attention, cfg.parsed_layout().layers
    expressible(all(k.mixer == "A" for k in kinds), "qwen3_vl_moe", "layout", cfg.layout, "softmax attention only")
    expressible(a.qk_norm and not a.output_gate, "qwen3_vl_moe", "attention", (a.qk_norm, a.output_gate),
                "QK-norm, no output gate")
    expressible(a.partial_rotary_factor == 1.0 and a.mrope_section is not None, "qwen3_vl_moe",
                "attention.mrope_section", a.mrope_section, "M-RoPE over the whole head")
    if cfg.moe is not None:
        m = cfg.moe
        expressible(m.norm_topk_prob and m.num_shared_experts == 0, "qwen3_vl_moe", "moe",
                    (m.norm_topk_prob, m.num_shared_experts), "renormalised top-k, no shared experts")


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    if cfg.vision is None:
        raise CheckpointError("export to qwen3_vl_moe: model.vision is not set (use qwen3_moe for a text model)")
    _check_text(cfg)
    out = base_hf_config(cfg, original, "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")
    text = qwen3_moe.config_to_hf(cfg, copy.deepcopy(out.get("text_config")) or None)
    for key in ("architectures", *TEXT_ONLY_KEYS):
        text.pop(key, None)
    text["model_type"] = "qwen3_vl_moe_text"
    text["rope_parameters"].update(mrope_section=list(cfg.attention.mrope_section), mrope_interleaved=True)
    vision = qwen_vision_to_hf(cfg.vision, cfg.hidden_size, out.get("vision_config"))
    vision.update(model_type="qwen3_vl_moe_vision", deepstack_visual_indexes=list(cfg.vision.deepstack_layers))
    out.update(text_config=text, vision_config=vision, image_token_id=cfg.vision.image_token_id,
               tie_word_embeddings=cfg.tie_embeddings)
    return out


# ---- mapping tables --------------------------------------------------------------------------

def _oriented(rows: int, cols: int):
    """HF stacked experts [E, cols, rows] (hub) or [E, rows, cols] (in-memory) -> megamoe's
    [E, rows, cols]; back to the hub's."""
    def forward(t, ctx):
        w = t[0]
        return w if tuple(w.shape[1:]) == (rows(ctx), cols(ctx)) and rows(ctx) != cols(ctx) else w.transpose(1, 2)

    return forward, lambda w, ctx: w.transpose(1, 2).contiguous()


def expert_rules(prefix: str) -> list[Rule]:
    h, f = (lambda ctx: ctx.cfg.hidden_size), (lambda ctx: ctx.cfg.moe.moe_ffn_hidden_size)
    gate_up = _oriented(lambda ctx: 2 * f(ctx), h)
    down = _oriented(h, f)
    mlp = "layers.{L}.mlp"
    return [Same(f"{mlp}.router.weight", f"{prefix}.gate.weight", when="e"),
            Fn(f"{mlp}.experts.gate_up_weight", (f"{prefix}.experts.gate_up_proj",), when="e", forward=gate_up[0],
               backward=gate_up[1]),
            Fn(f"{mlp}.experts.down_weight", (f"{prefix}.experts.down_proj",), when="e", forward=down[0],
               backward=down[1])]


def deepstack_rules(cfg: ModelConfig, prefix: str = "model.visual.") -> list[Rule]:
    parts = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
    return [Same(f"vision.deepstack.{i}.{ours}.{p}", f"{prefix}deepstack_merger_list.{i}.{theirs}.{p}")
            for i in range(len(cfg.vision.deepstack_layers)) for ours, theirs in parts.items()
            for p in ("weight", "bias")]


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    lm = "model.language_model."
    layer = f"{lm}layers.{{L}}"
    return [*embedding_rules(cfg, prefix=lm), *norm_rules(layer, "A"), *attention_rules(f"{layer}.self_attn", "A"),
            *dense_mlp_rules(f"{layer}.mlp"), *expert_rules(f"{layer}.mlp"), *qwen_vision_rules(cfg),
            *deepstack_rules(cfg)]


QWEN3_VL_MOE = register(Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", config_from_hf, config_to_hf,
                               rules, notes="GQA + QK-norm with interleaved M-RoPE, softmax top-k MoE, and Qwen3-VL's "
                               "tower (timm qwen3_vit) with DeepStack mergers; images, not video",
                               weight_dtypes=WITH_FP8))
