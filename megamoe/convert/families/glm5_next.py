"""GLM-5 next (``glm5_next``, ``Glm5NextForConditionalGeneration``): the text model and its vision tower.

KDA linear layers (``K``, safe gate) and indexed sparse MLA (``I``: no RoPE, pooled indexer)
by ``layer_types``; dense (``d``) or DeepSeek-style MoE (``e``: sigmoid, expert bias, shared
experts) by ``mlp_layer_types``; SwiGLU inputs clamped at ``swiglu_limit``; hyper-connections
(``model.hyper_connections``: ``hc_mult`` residual streams).

The vision tower (``model.visual.*``) is megamoe's timm-style ``glm5_vit_enc``
(megamoe.vision.glm_vit) with the ``glm_merger`` projector; a flat (text-only) config, whose
checkpoint holds no tower, converts to a text model, and a text model exports with a minimal
vision config (transformers initialises the tower it always builds). The multi-token-prediction
layers (``num_nextn_predict_layers`` after the last layer, ``layers.{N+D}.*`` DeepSeek-style with
hyper-connections; megamoe.convert.mtp) convert both ways.

HF names (under ``model.language_model.``; the stacked layout's in brackets)::

    layers.{L}.hc_attn_fn|base|scale [attn_hc.*]   -> layers.{L}.mixer_hc.fn|base|scale
    layers.{L}.hc_ffn_fn|base|scale [ffn_hc.*]     -> layers.{L}.mlp_hc.fn|base|scale
    self_attn.* ('K')                              -> KDA as kimi_linear (kimi_linear.kda_rules; A_log [H]):
        q|k|v|b_proj -> in_proj, q|k|v_conv1d [conv1d] -> conv_weight, A_log, dt_bias, f_a|f_b_proj
        [forget_gate.*] -> forget_gate.down|up, g_a|g_b_proj -> output_gate.down|up, o_norm, o_proj
    self_attn.q_a_proj ... o_proj ('I')            -> MLA names (deepseek_v3.mla_rules)
    self_attn.indexer.* ('I')                      -> deepseek_v32.indexer_rules + index_kpool_compress_ape|gate
    mlp.gate_proj|up_proj|down_proj ('d'); mlp.gate, experts, shared_experts ('e', deepseek_moe_rules)

Vision (the same names in both layouts)::

    model.visual.patch_embed.proj.weight [D, C, T, p, p] -> vision.encoder.model.patch_embed.proj.weight [D, C, p, p]
        (the T frames summed, as for qwen3_5_moe), .bias
    model.visual.blocks.{B}.norm1|norm2|attn.qkv|attn.proj|attn.q_norm|attn.k_norm -> vision.encoder.model.blocks.{B}.(same)
    model.visual.blocks.{B}.mlp.gate_proj|up_proj|down_proj -> ...blocks.{B}.mlp.fc1_g|fc1_x|fc2
    model.visual.post_layernorm                          -> vision.encoder.model.norm
    model.visual.downsample, merger.proj|gate_proj|up_proj|down_proj -> vision.projector.(same)
    model.visual.merger.post_projection_norm             -> vision.projector.norm
"""
from __future__ import annotations

import dataclasses

from megamoe.core.config import DSAConfig, HyperConnectionConfig, KDAConfig, ModelConfig
from megamoe.convert.families.common import base_hf_config, dense_mlp_rules, embedding_rules, norm_rules, text_config
from megamoe.convert.families.deepseek_v3 import (HF_LATENT_NORM_EPS, base_model_config, base_to_hf,
                                                  deepseek_moe_rules, expressible, mla_from_hf, mla_rules, mla_to_hf,
                                                  mlp_letters, mlp_types_to_hf)
from megamoe.convert.families.deepseek_v32 import indexer_rules as dsa_indexer_rules
from megamoe.convert.families.kimi_linear import kda_rules
from megamoe.convert.families.qwen3_5_moe import conv2d_to_3d, conv3d_to_2d
from megamoe.convert.family import Family, hf_get, register
from megamoe.convert.mtp import NEXTN_KEY, mtp_from_hf, mtp_to_hf, nextn_table
from megamoe.convert.table import Fn, Rule, Same, alternatives
from megamoe.core.errors import CheckpointError, ConfigError

LETTERS = {"linear_attention": "K", "indexed_attention": "I", "full_attention": "I"}
TINY_VISION = {"depth": 1, "hidden_size": 16, "num_heads": 1, "intermediate_size": 16,
               "projection_intermediate_size": 16}  # what transformers builds when there is no original


# ---- config --------------------------------------------------------------------------------

def layer_letters(text: dict) -> list[str]:
    n = hf_get(text, "num_hidden_layers")
    types = hf_get(text, "layer_types")
    if len(types) != n or any(t not in LETTERS for t in types):
        raise CheckpointError(f"config.json: text_config.layer_types={types} must give one of {list(LETTERS)} for "
                              f"each of num_hidden_layers={n} layers")
    shared = [i for i, t in enumerate(text.get("indexer_types") or []) if t != "full"]
    if shared:
        raise CheckpointError(f"config.json: text_config.indexer_types[{shared[0]}]="
                              f"{text['indexer_types'][shared[0]]!r} is not supported (megamoe's 'I' layers run "
                              f"their own indexer: allowed 'full')")
    return [LETTERS[t] for t in types]


def config_from_hf(hf: dict) -> ModelConfig:
    text = {**text_config(hf), "dtype": hf.get("dtype") or text_config(hf).get("dtype")}
    if text.get("qk_rope_head_dim"):
        raise CheckpointError(f"config.json: text_config.qk_rope_head_dim={text['qk_rope_head_dim']} is not "
                              f"supported (glm5_next's indexed attention has no RoPE)")
    layout = "".join(a + m for a, m in zip(layer_letters(text), mlp_letters(text, dense_default=3)))
    mtp = mtp_from_hf(text, NEXTN_KEY, LETTERS, "I", "e" in layout)
    letters = layout + (mtp.layout if mtp is not None else "")
    indexer = DSAConfig(num_heads=hf_get(text, "index_n_heads"), head_dim=hf_get(text, "index_head_dim"),
                        topk=hf_get(text, "index_topk"), kpool=hf_get(text, "index_kpool"),
                        select_tail=bool(text.get("index_kpool_always_select_tail", True)))
    # GLM-5 builds q_a_layernorm / kv_a_layernorm with rms_norm_eps (None: model.norm_eps)
    mla = dataclasses.replace(mla_from_hf(text, rope="none", indexer=indexer), latent_norm_eps=None)
    kda = KDAConfig(num_heads=hf_get(text, "linear_num_heads"), head_dim=hf_get(text, "linear_head_dim"),
                    conv_kernel=hf_get(text, "linear_conv_kernel_dim"), gate_lower_bound=text.get("linear_lower_bound"))
    cfg = base_model_config(text, layout, 2.5, mla=mla if "I" in letters else None, kda=kda if "K" in letters else None)
    cfg.mtp = mtp
    limit = float(hf_get(text, "swiglu_limit"))
    cfg.mlp.swiglu_limit = limit
    if cfg.moe is not None:
        cfg.moe.swiglu_limit = limit
    cfg.hyper_connections = HyperConnectionConfig(streams=hf_get(text, "hc_mult"),
                                                  sinkhorn_iters=hf_get(text, "hc_sinkhorn_iters"),
                                                  eps=float(text.get("hc_eps", 1e-6)))
    if hf.get("text_config") is not None and hf.get("vision_config") is not None:  # flat configs: text only
        from megamoe.vision.hf_glm import glm_vision_config

        try:
            cfg.vision = glm_vision_config(hf)
        except ConfigError as e:
            raise CheckpointError(f"config.json: {e}") from None
    return cfg


def _check_expressible(cfg: ModelConfig) -> None:
    layout = cfg.parsed_layout()
    expressible(all(k.mixer in "KI" and k.mlp in "de" for k in layout.layers), "glm5_next", "layout", cfg.layout,
                "mixers K or I, MLPs d or e")
    hc = cfg.hyper_connections
    expressible(hc is not None and hc.norm_eps in (None, cfg.norm_eps), "glm5_next", "hyper_connections", hc,
                "glm5_next layers use hyper-connections normalised with rms_norm_eps")
    limits = {cfg.mlp.swiglu_limit} | ({cfg.moe.swiglu_limit} if cfg.moe is not None else set())
    expressible(len(limits) == 1 and None not in limits, "glm5_next", "mlp.swiglu_limit", sorted(limits, key=str),
                "glm5_next clamps every SwiGLU at one swiglu_limit")
    if cfg.kda is not None:
        k = cfg.kda
        expressible(k.gate_rank is None, "glm5_next", "kda.gate_rank", k.gate_rank, "low-rank gates of rank head_dim")
        expressible(k.norm_eps in (None, cfg.norm_eps), "glm5_next", "kda.norm_eps", k.norm_eps, "rms_norm_eps")
    if cfg.mla is not None:
        m = cfg.mla
        expressible(m.latent_norm_eps in (None, cfg.norm_eps), "glm5_next", "mla.latent_norm_eps", m.latent_norm_eps,
                    "GLM-5's latent norms use rms_norm_eps")
        expressible(m.indexer is not None, "glm5_next", "mla.indexer", m.indexer, "'I' layers need the indexer")


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    _check_expressible(cfg)
    out = base_hf_config(cfg, original, "glm5_next", "Glm5NextForConditionalGeneration")
    text = base_to_hf(cfg, text_config(original) if original else None, "glm5_next_text", "Glm5NextTextModel")
    text.pop("architectures", None)
    layout = cfg.parsed_layout()
    text.update(layer_types=["linear_attention" if k.mixer == "K" else "indexed_attention" for k in layout.layers],
                indexer_types=["full"] * layout.num_layers, swiglu_limit=cfg.mlp.swiglu_limit,
                hc_mult=cfg.hyper_connections.streams, hc_sinkhorn_iters=cfg.hyper_connections.sinkhorn_iters,
                hc_eps=cfg.hyper_connections.eps, max_position_embeddings=text.get("max_position_embeddings",
                                                                                   cfg.max_seq_len))
    mlp_types_to_hf(cfg, text)
    mtp_to_hf(cfg, text, NEXTN_KEY, {"linear_attention": "K", "indexed_attention": "I"}, "I")
    if cfg.kda is not None:
        text.update(linear_num_heads=cfg.kda.num_heads, linear_head_dim=cfg.kda.head_dim,
                    linear_conv_kernel_dim=cfg.kda.conv_kernel, linear_lower_bound=cfg.kda.gate_lower_bound)
    if cfg.mla is not None:
        # mla_to_hf checks DeepSeek's fixed latent eps; GLM-5's is rms_norm_eps (checked above)
        mla_to_hf(dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, latent_norm_eps=HF_LATENT_NORM_EPS)),
                  text, "glm5_next", rope="none")
        ix = cfg.mla.indexer
        text.update(index_n_heads=ix.num_heads, index_head_dim=ix.head_dim, index_topk=ix.topk, index_kpool=ix.kpool,
                    index_kpool_always_select_tail=ix.select_tail, head_dim=0)
    pad = text.get("pad_token_id")
    if pad is None or not 0 <= pad < cfg.vocab_size:
        text["pad_token_id"] = None  # explicitly: transformers' default (154820) may lie outside the vocabulary
    out["text_config"] = text
    if cfg.vision is not None:
        out["vision_config"] = vision_to_hf(cfg, out.get("vision_config"))
        out["image_token_id"] = cfg.vision.image_token_id
    else:
        out.setdefault("vision_config", dict(TINY_VISION, out_hidden_size=cfg.hidden_size))
    out["tie_word_embeddings"] = cfg.tie_embeddings
    return out


def vision_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    from megamoe.vision.hf_glm import glm_vision_to_hf

    v = cfg.vision
    expressible(v.encoder == "glm5_vit_enc" and v.projector == "glm_merger", "glm5_next", "vision",
                (v.encoder, v.projector), "GLM-5's tower is glm5_vit_enc with the glm_merger projector")
    limit = v.encoder_args.get("swiglu_limit", 10.0)
    expressible(v.projector_swiglu_limit == limit, "glm5_next", "vision.projector_swiglu_limit",
                v.projector_swiglu_limit, f"GLM-5's merger clamps at the tower's swiglu_limit {limit}")
    expressible(v.projector_norm_eps == 1e-5, "glm5_next", "vision.projector_norm_eps", v.projector_norm_eps,
                "GLM-5's merger LayerNorm uses 1e-5")
    return glm_vision_to_hf(v, cfg.hidden_size, original)


# ---- table ---------------------------------------------------------------------------------

def hc_rules(layer: str, letters: str) -> list[Rule]:
    """Hyper-connection weights of both blocks; HF's saved names (hc_attn_fn) or its in-memory ones (attn_hc.fn)."""
    out = []
    for ours, hf_block in (("mixer_hc", "attn"), ("mlp_hc", "ffn")):
        for part in ("fn", "base", "scale"):
            mm = f"layers.{{L}}.{ours}.{part}"
            out += alternatives([Same(mm, f"{layer}.hc_{hf_block}_{part}", when=letters)],
                                [Same(mm, f"{layer}.{hf_block}_hc.{part}", when=letters)])
    return out


def indexer_rules(attn: str, letters: str = "I") -> list[Rule]:
    """GLM-5's pooled lightning indexer: DeepSeek-V3.2's tensors plus the pool's position
    embedding and gate (layers/mixers/dsa.py ``Indexer``)."""
    pool = {"pool_ape": "index_kpool_compress_ape", "linear_pool_gate.weight": "index_kpool_compress_gate"}
    return dsa_indexer_rules(attn, letters) + [Same(f"layers.{{L}}.mixer.indexer.{ours}", f"{attn}.indexer.{theirs}",
                                                    when=letters) for ours, theirs in pool.items()]


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    lm = "model.language_model"
    layer = f"{lm}.layers.{{L}}"
    out = [*embedding_rules(cfg, prefix=f"{lm}."), *norm_rules(layer, "KI"), *hc_rules(layer, "KI"),
           *dense_mlp_rules(f"{layer}.mlp")]
    if cfg.kda is not None:  # saved names, or transformers' in-memory ones (fused conv1d, forget_gate.*)
        kda = dict(a_log_shape=(-1,), low_rank=True)
        out += alternatives(kda_rules(f"{layer}.self_attn", forget="", split_conv=True, **kda),
                            kda_rules(f"{layer}.self_attn", forget="forget_gate.", split_conv=False, **kda))
    if cfg.mla is not None:
        out += [*mla_rules(f"{layer}.self_attn", "I", cfg), *indexer_rules(f"{layer}.self_attn")]
    if cfg.moe is not None:
        out += deepseek_moe_rules(f"{layer}.mlp")
    return nextn_table(out, cfg, layer) + (vision_rules(cfg) if cfg.vision is not None else [])


BLOCK = {"norm1": "norm1", "norm2": "norm2", "attn.q_norm": "attn.q_norm", "attn.k_norm": "attn.k_norm",
         "attn.qkv": "attn.qkv", "attn.proj": "attn.proj", "mlp.fc1_g": "mlp.gate_proj", "mlp.fc1_x": "mlp.up_proj",
         "mlp.fc2": "mlp.down_proj"}  # ours -> HF, under blocks.{B}.
PROJECTOR = {"downsample": "downsample", "proj": "merger.proj", "norm": "merger.post_projection_norm",
             "gate_proj": "merger.gate_proj", "up_proj": "merger.up_proj", "down_proj": "merger.down_proj"}
BLOCK_NO_BIAS = ("norm1", "norm2", "attn.q_norm", "attn.k_norm")  # RMSNorm weights
PROJECTOR_NO_BIAS = ("proj", "gate_proj", "up_proj", "down_proj")


def vision_rules(cfg: ModelConfig, prefix: str = "model.visual.") -> list[Rule]:
    """The tower (RMSNorms and q/k norms without bias; linears biased by attention_bias) and merger."""
    enc, a = "vision.encoder.model.", cfg.vision.encoder_args
    biased = ("weight", "bias") if a.get("bias", True) else ("weight",)
    rules: list[Rule] = [
        Fn(f"{enc}patch_embed.proj.weight", (f"{prefix}patch_embed.proj.weight",), forward=conv3d_to_2d,
           backward=conv2d_to_3d),
        Same(f"{enc}patch_embed.proj.bias", f"{prefix}patch_embed.proj.bias"),
        Same(f"{enc}norm.weight", f"{prefix}post_layernorm.weight")]
    for b in range(int(a.get("depth", 24))):
        rules += [Same(f"{enc}blocks.{b}.{ours}.{p}", f"{prefix}blocks.{b}.{theirs}.{p}")
                  for ours, theirs in BLOCK.items() for p in (("weight",) if ours in BLOCK_NO_BIAS else biased)]
    rules += [Same(f"vision.projector.{ours}.{p}", f"{prefix}{theirs}.{p}") for ours, theirs in PROJECTOR.items()
              for p in (("weight",) if ours in PROJECTOR_NO_BIAS else ("weight", "bias"))]
    return rules


GLM5_NEXT = register(Family("glm5_next", "Glm5NextForConditionalGeneration", config_from_hf, config_to_hf, rules,
                            notes="KDA + pooled DSA, hyper-connections, clamped SwiGLU, and the vision tower "
                            "(megamoe's timm-style glm5_vit_enc + glm_merger; images, not video); MTP layers"))
