"""Qwen3-MoE (``qwen3_moe``): GQA with QK-norm, softmax top-k routed experts, plain RMSNorm.

Layers are MoE (``e``) unless HF makes them dense (``d``): a layer is sparse when it is not in
``mlp_only_layers`` and ``(index + 1) % decoder_sparse_step == 0`` (the rule qwen3_moe and
qwen3_next share, see ``mlp_letters``).
"""
from __future__ import annotations

from megamoe.core.config import MLPConfig, ModelConfig, MoEConfig
from megamoe.convert.family import WITH_FP8, Family, hf_get, register
from megamoe.convert.families.common import (attention_rules, base_hf_config, dense_mlp_rules, dtype_name,
                                             embedding_rules, moe_rules, norm_rules)
from megamoe.convert.families.qwen3 import attention_from_hf, attention_to_hf, common_to_hf
from megamoe.core.errors import CheckpointError


def num_experts(hf: dict, required: bool = True) -> int:
    """HF configs name the expert count num_experts or (attribute_map) num_local_experts."""
    found = hf.get("num_experts", hf.get("num_local_experts"))
    return hf_get({"num_experts": found, "model_type": hf.get("model_type")}, "num_experts", 0, required)


def mlp_letters(hf: dict) -> list[str]:
    """'e' or 'd' per layer from num_experts, decoder_sparse_step and mlp_only_layers."""
    n, experts = hf_get(hf, "num_hidden_layers"), num_experts(hf, required=False)
    step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
    return ["e" if experts > 0 and i not in dense and (i + 1) % step == 0 else "d" for i in range(n)]


def sparse_layout_to_hf(cfg: ModelConfig, out: dict) -> None:
    """decoder_sparse_step / mlp_only_layers giving the layout's MLP letters (the original's
    values are kept when they already do)."""
    want = [kind.mlp for kind in cfg.parsed_layout().layers]
    out["num_hidden_layers"] = len(want)
    if mlp_letters(out) != want:
        out.update(decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(want) if m == "d"])


def moe_from_hf(hf: dict, **kw) -> MoEConfig:
    """Softmax top-k routing; transformers' aux loss is top_k times megamoe's (tests/test_moe_hf.py)."""
    top_k = hf_get(hf, "num_experts_per_tok")
    aux = hf.get("router_aux_loss_coef", 0.0) * top_k if hf.get("output_router_logits") else 0.0
    return MoEConfig(num_experts=num_experts(hf), top_k=top_k,
                     moe_ffn_hidden_size=hf_get(hf, "moe_intermediate_size"), score_function="softmax",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", True)), aux_loss_coeff=aux, **kw)


def moe_to_hf(moe: MoEConfig, out: dict) -> None:
    key = "num_local_experts" if "num_local_experts" in out and "num_experts" not in out else "num_experts"
    out.update({key: moe.num_experts}, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob)
    if moe.aux_loss_coeff > 0:
        out.update(router_aux_loss_coef=moe.aux_loss_coeff / moe.top_k, output_router_logits=True)


def check_moe_routing(cfg: ModelConfig, model_type: str) -> None:
    """What the HF softmax top-k router can express (an export must not change the model)."""
    m = cfg.moe
    if m.score_function != "softmax" or m.n_group != 1 or m.expert_bias or m.routed_scaling_factor != 1.0:
        raise CheckpointError(f"export to {model_type}: model.moe must use plain softmax top-k routing "
                              f"(score_function={m.score_function!r}, n_group={m.n_group}, "
                              f"expert_bias={m.expert_bias}, routed_scaling_factor={m.routed_scaling_factor})")


def config_from_hf(hf: dict) -> ModelConfig:
    if hf.get("use_sliding_window"):
        raise CheckpointError("config.json: use_sliding_window=true is not supported for qwen3_moe")
    layout = "".join("A" + m for m in mlp_letters(hf))
    return ModelConfig(vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"), layout=layout,
                       attention=attention_from_hf(hf), mlp=MLPConfig(ffn_hidden_size=hf_get(hf, "intermediate_size")),
                       moe=moe_from_hf(hf) if "e" in layout else None, norm_eps=hf.get("rms_norm_eps", 1e-6),
                       tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       max_seq_len=hf.get("max_position_embeddings", 4096), params_dtype=dtype_name(hf))


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out = base_hf_config(cfg, original, "qwen3_moe", "Qwen3MoeForCausalLM")
    common_to_hf(cfg, out)
    attention_to_hf(cfg, out)
    out.update(intermediate_size=cfg.mlp.ffn_hidden_size, hidden_act="silu")
    if cfg.moe is not None:
        check_moe_routing(cfg, "qwen3_moe")
        moe_to_hf(cfg.moe, out)
        out["moe_intermediate_size"] = cfg.moe.moe_ffn_hidden_size
    else:
        out.pop("num_local_experts", None)
        out["num_experts"] = 0
    sparse_layout_to_hf(cfg, out)
    return out


def rules(cfg: ModelConfig, hf: dict):
    layer = "model.layers.{L}"
    return [*embedding_rules(cfg), *norm_rules(layer, "A"), *attention_rules(f"{layer}.self_attn", "A"),
            *dense_mlp_rules(f"{layer}.mlp"), *moe_rules(f"{layer}.mlp")]


QWEN3_MOE = register(Family("qwen3_moe", "Qwen3MoeForCausalLM", config_from_hf, config_to_hf, rules,
                            notes="GQA + QK-norm, softmax top-k MoE, dense layers by decoder_sparse_step",
                            weight_dtypes=WITH_FP8))
