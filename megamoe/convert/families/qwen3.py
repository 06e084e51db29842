"""Qwen3 dense (``qwen3``): GQA with QK-norm, SwiGLU, plain RMSNorm.

``attention_from_hf`` / ``attention_to_hf`` (shared by qwen3_moe, qwen3_next, mixtral, minimax)
map RoPE, YaRN included (``rope_parameters`` or the legacy ``rope_scaling`` with
``rope_type: yarn`` <-> ``model.attention.yarn``)."""
from __future__ import annotations

from megamoe.core.config import AttentionConfig, MLPConfig, ModelConfig
from megamoe.convert.family import WITH_FP8, Family, hf_get, register
from megamoe.core.errors import CheckpointError
from megamoe.convert.families.common import (attention_rules, base_hf_config, dense_mlp_rules, dtype_name,
                                             embedding_rules, norm_rules, rope_theta, rope_to_hf,
                                             yarn_from_hf)


def attention_from_hf(hf: dict, qk_norm: bool = True, output_gate: bool = False) -> AttentionConfig:
    return AttentionConfig(num_heads=hf_get(hf, "num_attention_heads"), num_kv_heads=hf_get(hf, "num_key_value_heads"),
                           head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                           qk_norm=qk_norm, output_gate=output_gate, rope_theta=rope_theta(hf),
                           qkv_bias=bool(hf.get("attention_bias", False)), yarn=yarn_from_hf(hf))


def attention_to_hf(cfg: ModelConfig, out: dict) -> None:
    a = cfg.attention
    out.update(num_attention_heads=a.num_heads, num_key_value_heads=a.kv_heads(), head_dim=a.dim(cfg.hidden_size),
               attention_bias=a.qkv_bias)
    rope_to_hf(a.rope_theta, a.yarn, out)


def common_to_hf(cfg: ModelConfig, out: dict) -> None:
    out.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.parsed_layout().num_layers,
               rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
               max_position_embeddings=out.get("max_position_embeddings", cfg.max_seq_len))


def config_from_hf(hf: dict) -> ModelConfig:
    if hf.get("use_sliding_window"):
        raise CheckpointError("config.json: use_sliding_window=true is not supported for qwen3")
    n = hf_get(hf, "num_hidden_layers")
    return ModelConfig(vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"), layout="Ad" * n,
                       attention=attention_from_hf(hf), mlp=MLPConfig(ffn_hidden_size=hf_get(hf, "intermediate_size")),
                       norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       max_seq_len=hf.get("max_position_embeddings", 4096), params_dtype=dtype_name(hf))


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out = base_hf_config(cfg, original, "qwen3", "Qwen3ForCausalLM")
    common_to_hf(cfg, out)
    attention_to_hf(cfg, out)
    out.update(intermediate_size=cfg.mlp.ffn_hidden_size, hidden_act="silu",
               layer_types=["full_attention"] * cfg.parsed_layout().num_layers)
    return out


def rules(cfg: ModelConfig, hf: dict):
    layer = "model.layers.{L}"
    return [*embedding_rules(cfg), *norm_rules(layer, "A"), *attention_rules(f"{layer}.self_attn", "A"),
            *dense_mlp_rules(f"{layer}.mlp")]


QWEN3 = register(Family("qwen3", "Qwen3ForCausalLM", config_from_hf, config_to_hf, rules,
                        weight_dtypes=WITH_FP8))
