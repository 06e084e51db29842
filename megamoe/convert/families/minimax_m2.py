"""MiniMax-M2 (``minimax_m2``): GQA softmax attention with one QK-norm over all heads and
partial RoPE, every MLP a sigmoid-routed MoE without shared experts.

Attention: q/k/v/o projections, ``q_norm`` [heads * head_dim] and ``k_norm`` [kv_heads *
head_dim] each normalise all heads of a token at once (``attention.qk_norm_scope: all``); the
first ``rotary_dim`` (or ``partial_rotary_factor * head_dim``) channels are rotated
(rotate-half). Routing: sigmoid scores, top-k chosen on scores plus the selection bias
``e_score_correction_bias`` (-> ``router.expert_bias``), the chosen scores renormalised, no
scaling. The hub layout keeps the MoE under ``block_sparse_moe`` (experts ``w1`` gate, ``w3``
up, ``w2`` down, the bias beside the router); transformers' in-memory layout under ``mlp``.
``router_aux_loss_coef`` is a training setting of transformers' softmax balancing loss and is
not carried over (megamoe's losses are set in ``model.moe``).

Also the pieces MiniMax-M3 (``minimax_m3_vl.py``) builds on: ``attention_section``,
``sigmoid_moe``, ``mm_moe_rules``.
"""
from __future__ import annotations

from megamoe.core.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig
from megamoe.convert.families.common import (attention_rules, base_hf_config, dtype_name, embedding_rules,
                                             moe_rules, norm_rules, partial_rotary)
from megamoe.convert.families.deepseek_v3 import check_silu, expressible
from megamoe.convert.families.qwen3 import attention_from_hf, attention_to_hf, common_to_hf
from megamoe.convert.family import WITH_FP8, Family, hf_get, register


def attention_section(hf: dict, qk_norm_scope: str) -> AttentionConfig:
    """GQA with QK-norm (``qk_norm_scope``) and partial rotary, as MiniMax-M2/M3 configure it."""
    attention = attention_from_hf(hf, qk_norm=True)
    attention.qk_norm_scope = qk_norm_scope
    rotary = hf.get("rotary_dim")
    attention.partial_rotary_factor = rotary / attention.dim(hf_get(hf, "hidden_size")) if rotary else \
        partial_rotary(hf)
    return attention


def attention_section_to_hf(cfg: ModelConfig, out: dict, model_type: str, qk_norm_scope: str) -> None:
    a = cfg.attention
    for field, value, want in (("qk_norm", a.qk_norm, True), ("qk_norm_scope", a.qk_norm_scope, qk_norm_scope),
                               ("output_gate", a.output_gate, False), ("qkv_bias", a.qkv_bias, False),
                               ("softmax_scale", a.softmax_scale, None), ("mrope_section", a.mrope_section, None)):
        expressible(value == want, model_type, f"attention.{field}", value, f"{model_type} has {want!r}")
    attention_to_hf(cfg, out)
    out.pop("attention_bias", None)
    out["rotary_dim"] = a.rotary_dim(cfg.hidden_size)
    out["rope_parameters"]["partial_rotary_factor"] = a.partial_rotary_factor


def sigmoid_moe(hf: dict, ffn: int, **kw) -> MoEConfig:
    """MiniMax routing: sigmoid scores, selection bias, renormalised top-k (``kw``: scaling, shared)."""
    return MoEConfig(num_experts=hf.get("num_local_experts") or hf_get(hf, "num_experts"),
                     top_k=hf_get(hf, "num_experts_per_tok"), moe_ffn_hidden_size=ffn, score_function="sigmoid",
                     norm_topk_prob=True, expert_bias=True, **kw)


def sigmoid_moe_to_hf(cfg: ModelConfig, out: dict, model_type: str, scaling: bool, shared: int) -> None:
    m = cfg.moe
    for field, value, want in (("score_function", m.score_function, "sigmoid"), ("n_group", m.n_group, 1),
                               ("norm_topk_prob", m.norm_topk_prob, True), ("expert_bias", m.expert_bias, True),
                               ("shared_expert_gate", m.shared_expert_gate, False),
                               ("num_shared_experts", m.num_shared_experts, shared)):
        expressible(value == want, model_type, f"moe.{field}", value, f"{model_type} has {want!r}")
    expressible(scaling or m.routed_scaling_factor == 1.0, model_type, "moe.routed_scaling_factor",
                m.routed_scaling_factor, f"{model_type} does not scale the routed weights")
    out.pop("num_experts", None)
    out.update(num_local_experts=m.num_experts, num_experts_per_tok=m.top_k)


def mm_moe_rules(layer: str, **kw) -> list:
    """Router, selection bias and experts: hub ``block_sparse_moe`` (w1/w3/w2) or in-memory ``mlp``."""
    return moe_rules(f"{layer}.block_sparse_moe", stacked_prefix=f"{layer}.mlp", expert_names=("w1", "w3", "w2"),
                     expert_bias="e_score_correction_bias", **kw)


def config_from_hf(hf: dict) -> ModelConfig:
    check_silu(hf)
    n = hf_get(hf, "num_hidden_layers")
    return ModelConfig(vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"), layout="Ae" * n,
                       attention=attention_section(hf, "all"),
                       mlp=MLPConfig(ffn_hidden_size=hf_get(hf, "intermediate_size")),
                       moe=sigmoid_moe(hf, hf_get(hf, "intermediate_size")), norm_eps=hf.get("rms_norm_eps", 1e-6),
                       tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       max_seq_len=hf.get("max_position_embeddings", 4096), params_dtype=dtype_name(hf))


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out = base_hf_config(cfg, original, "minimax_m2", "MiniMaxM2ForCausalLM")
    expressible(set(cfg.parsed_layout().compact()) <= set("Ae"), "minimax_m2", "layout", cfg.layout,
                "every layer is Ae")
    common_to_hf(cfg, out)
    attention_section_to_hf(cfg, out, "minimax_m2", "all")
    sigmoid_moe_to_hf(cfg, out, "minimax_m2", scaling=False, shared=0)
    for field in ("swiglu_limit", "swiglu_alpha"):
        value = getattr(cfg.moe, field)
        expressible(value is None, "minimax_m2", f"moe.{field}", value, "plain SwiGLU")
    out.update(intermediate_size=cfg.moe.moe_ffn_hidden_size, hidden_act="silu")
    return out


def rules(cfg: ModelConfig, hf: dict):
    layer = "model.layers.{L}"
    return [*embedding_rules(cfg), *norm_rules(layer, "A", mlp_letters="e"),
            *attention_rules(f"{layer}.self_attn", "A"), *mm_moe_rules(layer)]


MINIMAX_M2 = register(Family("minimax_m2", "MiniMaxM2ForCausalLM", config_from_hf, config_to_hf, rules,
                             notes="GQA (QK-norm over all heads, partial RoPE) + sigmoid top-k MoE with the "
                                   "selection bias", weight_dtypes=WITH_FP8))
