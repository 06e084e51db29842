"""Ling 2.5 (``bailing_hybrid``): KDA with full-rank gates and the safe gate (letter ``K``,
``kda.gate_rank=0``, ``gate_lower_bound=kda_lower_bound``) and MLA with interleaved RoPE and a
per-head sigmoid output gate (``M``, ``mla.head_gate``) per ``layer_types`` (default: the last
layer of every ``layer_group_size`` is MLA); dense SwiGLU or DeepSeek-style MoE with group
routing per ``mlp_layer_types`` (deepseek_v3.py).

``save_pretrained`` writes the hub names, transformers keeps others in memory (written with
``save_original_format=False``); both import, exports write the hub names:

    hub (default save)                                  in memory
    model.word_embeddings                               model.embed_tokens
    layers.N.attention.*                                layers.N.self_attn.*
    attention.dense (both mixers' output projection)    self_attn.o_proj
    attention.q_conv1d / k_conv1d / v_conv1d            self_attn.conv1d
    attention.A_log [H], dt_bias, f_proj                self_attn.forget_gate.A_log, .dt_bias, .f_proj
    mlp.gate.expert_bias                                mlp.gate.e_score_correction_bias
    mlp.experts.{E}.gate_proj / up_proj / down_proj     mlp.experts.gate_up_proj / .down_proj

The KDA's head count is num_attention_heads, its head size ``linear_head_dim`` (transformers) or
``head_dim`` (hub config; transformers then overwrites head_dim with qk_rope_head_dim).
"""
from __future__ import annotations

from megamoe.core.config import KDAConfig, ModelConfig
from megamoe.convert.families.common import dense_mlp_rules, embedding_rules, norm_rules
from megamoe.convert.families.deepseek_v3 import (base_model_config, deepseek_moe_rules, expressible, mla_from_hf,
                                                  mla_rules, mlp_letters)
from megamoe.convert.families.kimi_linear import MIXER_LETTERS, hybrid_to_hf, kda_rules, layer_types_to_letters
from megamoe.convert.family import Family, hf_get, register
from megamoe.convert.mtp import NEXTN, NEXTN_KEY, mtp_from_hf, mtp_to_hf, nextn_table
from megamoe.convert.table import Rule, Same, alternatives
from megamoe.core.errors import CheckpointError

ROPE_THETA = 6_000_000.0  # transformers' default for bailing_hybrid
MTP_NAMES = {**NEXTN, "final_norm": "final_layernorm"}  # Ling's MTP layer (megamoe.convert.mtp)


def kda_from_hf(hf: dict) -> KDAConfig:
    heads = hf_get(hf, "num_attention_heads")
    if hf.get("linear_num_heads", heads) != heads:
        raise CheckpointError(f"config.json: linear_num_heads={hf['linear_num_heads']} must equal "
                              f"num_attention_heads={heads} for bailing_hybrid")
    return KDAConfig(num_heads=heads, head_dim=hf.get("linear_head_dim") or hf_get(hf, "head_dim"),
                     conv_kernel=hf.get("linear_conv_kernel_dim") or hf.get("short_conv_kernel_size") or 4,
                     gate_rank=0, gate_lower_bound=hf.get("kda_lower_bound", -5.0) if hf.get("kda_safe_gate", True)
                     else None)


def config_from_hf(hf: dict) -> ModelConfig:
    n = hf_get(hf, "num_hidden_layers")
    group = hf.get("layer_group_size") or 6
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % group == 0 else "linear_attention"
                                      for i in range(n)]
    layout = "".join(a + b for a, b in zip(layer_types_to_letters(types, n), mlp_letters(hf, dense_default=2)))
    mtp = mtp_from_hf(hf, NEXTN_KEY, MIXER_LETTERS, "M", "e" in layout)
    letters = layout + (mtp.layout if mtp is not None else "")
    sections = {"kda": kda_from_hf(hf)} if "K" in letters else {}
    if "M" in letters:
        sections["mla"] = mla_from_hf(hf, rope="interleaved", head_gate=True, default_theta=ROPE_THETA)
    cfg = base_model_config(hf, layout, 2.5, **sections)
    cfg.mtp = mtp
    return cfg


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out, types = hybrid_to_hf(cfg, original, "bailing_hybrid", "BailingHybridForCausalLM", rope="interleaved",
                              head_gate=True)
    if cfg.kda is not None and "linear_attention" in types:
        k = cfg.kda
        expressible(cfg.mla is None or k.num_heads == cfg.mla.num_heads, "bailing_hybrid", "kda.num_heads",
                    k.num_heads, "bailing_hybrid's KDA has num_attention_heads heads")
        expressible(k.gate_rank == 0, "bailing_hybrid", "kda.gate_rank", k.gate_rank, "full-rank gates")
        expressible(k.norm_eps in (None, cfg.norm_eps), "bailing_hybrid", "kda.norm_eps", k.norm_eps, "rms_norm_eps")
        out.update(num_attention_heads=k.num_heads, linear_num_heads=k.num_heads, head_dim=k.head_dim,
                   linear_head_dim=k.head_dim, linear_conv_kernel_dim=k.conv_kernel,
                   short_conv_kernel_size=k.conv_kernel,
                   kda_safe_gate=k.gate_lower_bound is not None)
        if k.gate_lower_bound is not None:
            out["kda_lower_bound"] = k.gate_lower_bound
    mtp_to_hf(cfg, out, NEXTN_KEY, MIXER_LETTERS, "M")
    return out


def layer_rules(cfg: ModelConfig, *, hub: bool) -> list[Rule]:
    """Embedding and layer tensors in the hub layout (``hub``) or transformers' in-memory one."""
    layer = "model.layers.{L}"
    attn = f"{layer}.attention" if hub else f"{layer}.self_attn"
    o_proj = "dense" if hub else "o_proj"
    embedding = "model.word_embeddings.weight" if hub else "model.embed_tokens.weight"
    rules: list[Rule] = [Same("embedding.weight", embedding)]
    if cfg.kda is not None:
        rules += kda_rules(attn, forget="" if hub else "forget_gate.", split_conv=hub, a_log_shape=(-1,),
                           low_rank=False, o_proj=o_proj)
    if cfg.mla is not None:
        rules += mla_rules(attn, "M", cfg, o_proj=o_proj)
    bias = "gate.expert_bias" if hub else "gate.e_score_correction_bias"
    return rules + deepseek_moe_rules(f"{layer}.mlp", expert_bias=bias)


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    return nextn_table([*alternatives(layer_rules(cfg, hub=True), layer_rules(cfg, hub=False)),
                        *embedding_rules(cfg)[1:],  # final norm and head: the same names in both layouts
                        *norm_rules("model.layers.{L}", "KM"), *dense_mlp_rules("model.layers.{L}.mlp")], cfg,
                       names=MTP_NAMES)


BAILING_HYBRID = register(Family("bailing_hybrid", "BailingHybridForCausalLM", config_from_hf, config_to_hf, rules,
                                 notes="safe-gate KDA + gated MLA + group-routed MoE; hub and in-memory names; MTP"))
