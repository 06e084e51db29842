"""Mixtral (``mixtral``): GQA without QK-norm, softmax top-2 routing renormalised, plain RMSNorm.

Every layer is MoE. With ``sliding_window`` set the layers are ``S`` (each query sees that many
tokens, itself included, as transformers' sliding-window mask), else ``A``. The per-expert layout
keeps the experts under ``block_sparse_moe`` as ``w1`` (gate), ``w3`` (up), ``w2`` (down); the
stacked layout moves the router and experts to ``mlp``.
"""
from __future__ import annotations

from megamoe.core.config import ModelConfig
from megamoe.convert.family import Family, hf_get, register
from megamoe.convert.families.common import (attention_rules, base_hf_config, dtype_name, embedding_rules,
                                             moe_rules, norm_rules)
from megamoe.convert.families.qwen3 import attention_from_hf, attention_to_hf, common_to_hf
from megamoe.convert.families.qwen3_moe import check_moe_routing, moe_from_hf, moe_to_hf
from megamoe.core.errors import CheckpointError


def config_from_hf(hf: dict) -> ModelConfig:
    n, window = hf_get(hf, "num_hidden_layers"), hf.get("sliding_window") or 0
    attention = attention_from_hf(hf, qk_norm=False)
    attention.sliding_window = window
    # Mixtral's router always renormalises its top-k weights
    moe = moe_from_hf({**hf, "norm_topk_prob": True, "moe_intermediate_size": hf_get(hf, "intermediate_size")})
    return ModelConfig(vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"),
                       layout=("Se" if window else "Ae") * n,
                       attention=attention, moe=moe, norm_eps=hf.get("rms_norm_eps", 1e-5),
                       tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       max_seq_len=hf.get("max_position_embeddings", 4096), params_dtype=dtype_name(hf))


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out = base_hf_config(cfg, original, "mixtral", "MixtralForCausalLM")
    kinds = {str(k) for k in cfg.parsed_layout().layers}
    if not kinds <= {"Ae", "Se"} or len(kinds) != 1:
        raise CheckpointError(f"export to mixtral: model.layout={cfg.layout!r} must be all 'Ae' or all 'Se'")
    if not cfg.moe.norm_topk_prob or cfg.moe.num_shared_experts:
        raise CheckpointError("export to mixtral: model.moe must renormalise top-k weights and have no shared experts")
    check_moe_routing(cfg, "mixtral")
    common_to_hf(cfg, out)
    attention_to_hf(cfg, out)
    out.pop("attention_bias", None)
    moe_to_hf(cfg.moe, out)
    out.pop("norm_topk_prob", None)
    out.update(intermediate_size=cfg.moe.moe_ffn_hidden_size, hidden_act="silu",
               sliding_window=cfg.attention.sliding_window if "Se" in kinds else None)
    return out


def rules(cfg: ModelConfig, hf: dict):
    layer = "model.layers.{L}"
    return [*embedding_rules(cfg), *norm_rules(layer, "AS", mlp_letters="e"),
            *attention_rules(f"{layer}.self_attn", "AS", q_norm=None),
            *moe_rules(f"{layer}.block_sparse_moe", stacked_prefix=f"{layer}.mlp", expert_names=("w1", "w3", "w2"))]


MIXTRAL = register(Family("mixtral", "MixtralForCausalLM", config_from_hf, config_to_hf, rules,
                          notes="GQA (sliding window -> S) + softmax top-2 MoE; block_sparse_moe or mlp names"))
