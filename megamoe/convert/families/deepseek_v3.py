"""DeepSeek-V3 (``deepseek_v3``): MLA (letter ``M``) with interleaved (or rotate-half) RoPE and
YaRN, a dense SwiGLU in the first ``first_k_dense_replace`` layers, routed experts elsewhere.

Routing: sigmoid scores, group-limited top-k (a group scores the sum of its best two), the
aux-loss-free selection bias ``gate.e_score_correction_bias`` -> ``router.expert_bias`` (it
changes which experts are chosen, not their weights), renormalised weights times
``routed_scaling_factor``, plus ``n_shared_experts`` shared experts fused into one SwiGLU.

Also the pieces the other MLA + DeepSeek-MoE families (deepseek_v32, kimi_linear,
bailing_hybrid) build on: ``mla_from_hf``/``mla_to_hf``/``mla_rules``, ``moe_from_hf``/
``moe_to_hf``/``deepseek_moe_rules``, ``mlp_letters``.
"""
from __future__ import annotations

import re

from megamoe.core.config import MLAConfig, MLPConfig, ModelConfig, MoEConfig, YarnConfig
from megamoe.convert.families.common import (base_hf_config, dense_mlp_rules, dtype_name, embedding_rules, moe_rules,
                                             norm_rules, rope_theta, rope_to_hf, yarn_from_hf)
from megamoe.convert.family import WITH_FP8, Family, hf_get, register
from megamoe.convert.mtp import NEXTN_KEY, mtp_from_hf, mtp_to_hf, nextn_table
from megamoe.convert.table import Rule, Same
from megamoe.core.errors import CheckpointError

HF_LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the default eps, whatever rms_norm_eps


def expressible(ok: bool, model_type: str, field: str, value, why: str) -> None:
    """An export must not change the model: a setting transformers cannot hold is an error."""
    if not ok:
        raise CheckpointError(f"export to {model_type}: model.{field}={value!r} cannot be expressed ({why})")


def first(hf: dict, keys: tuple[str, ...], default=None):
    """The first of ``keys`` the config sets (families spell some fields differently); a missing
    required one is a one-line error naming the first spelling."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return hf_get(hf, keys[0], default, required=default is None)


# ---- RoPE and MLA --------------------------------------------------------------------------

def mla_from_hf(hf: dict, *, rope: str, head_gate: bool = False, default_theta: float = 10000.0,
                indexer=None) -> MLAConfig:
    """MLA as DeepseekV3Attention and its descendants build it (``rope``: interleaved, half, none)."""
    heads = hf_get(hf, "num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise CheckpointError(f"config.json: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} "
                              f"for MLA (every head expands its own keys and values)")
    if hf.get("attention_bias"):
        raise CheckpointError("config.json: attention_bias=true is not supported for MLA")
    return MLAConfig(num_heads=heads, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf_get(hf, "kv_lora_rank"),
                     qk_nope_head_dim=hf_get(hf, "qk_nope_head_dim"), qk_rope_head_dim=hf_get(hf, "qk_rope_head_dim"),
                     v_head_dim=hf_get(hf, "v_head_dim"), rope=rope, rope_theta=rope_theta(hf, default_theta),
                     yarn=YarnConfig() if rope == "none" else yarn_from_hf(hf), head_gate=head_gate,
                     latent_norm_eps=HF_LATENT_NORM_EPS, indexer=indexer)


def mla_to_hf(cfg: ModelConfig, out: dict, model_type: str, *, rope: str, head_gate: bool = False) -> None:
    m = cfg.mla
    expressible(m.rope == rope, model_type, "mla.rope", m.rope, f"{model_type} uses {rope}")
    expressible(m.head_gate == head_gate, model_type, "mla.head_gate", m.head_gate, f"{model_type} has {head_gate}")
    eps = m.latent_norm_eps or cfg.norm_eps
    expressible(eps == HF_LATENT_NORM_EPS, model_type, "mla.latent_norm_eps", eps, "HF's latent norms use 1e-6")
    expressible(m.softmax_scale is None, model_type, "mla.softmax_scale", m.softmax_scale, "HF derives it")
    expressible(rope != "none" or m.yarn.factor == 1, model_type, "mla.yarn.factor", m.yarn.factor, "no RoPE")
    out.update(num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads, q_lora_rank=m.q_lora_rank,
               kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
               v_head_dim=m.v_head_dim, qk_head_dim=m.qk_nope_head_dim + m.qk_rope_head_dim, attention_bias=False)
    if rope != "none":
        rope_to_hf(m.rope_theta, m.yarn, out)


def mla_rules(prefix: str, letters: str, cfg: ModelConfig, *, o_proj: str = "o_proj") -> list[Rule]:
    """MLA (layers/mixers/mla.py) from HF's DeepseekV3Attention names (same layouts: q_b_proj rows per
    head [nope | rope], kv_a_proj_with_mqa rows [latent | k_rope], kv_b_proj rows per head [k_nope | v])."""
    names = {"linear_kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "linear_kv_up": "kv_b_proj",
             "linear_proj": o_proj}
    if cfg.mla.q_lora_rank is None:
        names["linear_q"] = "q_proj"
    else:
        names.update(linear_q_down="q_a_proj", q_norm="q_a_layernorm", linear_q="q_b_proj")
    if cfg.mla.head_gate:
        names["linear_gate"] = "g_proj"
    return [Same(f"layers.{{L}}.mixer.{ours}.weight", f"{prefix}.{theirs}.weight", when=letters)
            for ours, theirs in names.items()]


# ---- DeepSeek MoE --------------------------------------------------------------------------

# field -> spellings (DeepSeek's first; kimi_linear and bailing_hybrid write the second)
MOE_KEYS = {"num_experts": ("n_routed_experts", "num_experts"),
            "top_k": ("num_experts_per_tok", "num_experts_per_token"),
            "num_shared": ("n_shared_experts", "num_shared_experts"), "n_group": ("n_group", "num_expert_group"),
            "renormalize": ("norm_topk_prob", "moe_renormalize")}


def moe_from_hf(hf: dict, scaling_default: float) -> MoEConfig:
    shared = first(hf, MOE_KEYS["num_shared"], 1)
    if shared < 1:
        raise CheckpointError(f"config.json: {MOE_KEYS['num_shared'][0]}={shared} is not supported "
                              f"(at least 1 shared expert)")
    ffn = hf_get(hf, "moe_intermediate_size")
    return MoEConfig(num_experts=first(hf, MOE_KEYS["num_experts"]), top_k=first(hf, MOE_KEYS["top_k"]),
                     moe_ffn_hidden_size=ffn, num_shared_experts=shared, shared_expert_ffn_hidden_size=ffn,
                     score_function="sigmoid", n_group=first(hf, MOE_KEYS["n_group"], 1),
                     topk_group=hf.get("topk_group") or 1, group_score_topk=2,
                     norm_topk_prob=bool(first(hf, MOE_KEYS["renormalize"], True)),
                     routed_scaling_factor=float(hf.get("routed_scaling_factor") or scaling_default), expert_bias=True)


def moe_to_hf(cfg: ModelConfig, out: dict, model_type: str, spelling: int = 0) -> None:
    """``spelling``: 0 for DeepSeek's key names, 1 for kimi_linear's and bailing_hybrid's."""
    m = cfg.moe
    for field, value, want in (("score_function", m.score_function, "sigmoid"),
                               ("group_score_topk", m.group_score_topk, 2), ("expert_bias", m.expert_bias, True),
                               ("shared_expert_gate", m.shared_expert_gate, False), ("swiglu_alpha", m.swiglu_alpha, None),
                               ("shared_expert_ffn_hidden_size", m.shared_ffn(),
                                m.moe_ffn_hidden_size * max(m.num_shared_experts, 1))):
        expressible(value == want, model_type, f"moe.{field}", value, f"{model_type} has {want!r}")
    values = {"num_experts": m.num_experts, "top_k": m.top_k, "num_shared": m.num_shared_experts,
              "n_group": m.n_group, "renormalize": m.norm_topk_prob}
    out.update({MOE_KEYS[k][spelling]: v for k, v in values.items()})
    out.update(topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor,
               moe_intermediate_size=m.moe_ffn_hidden_size)


def deepseek_moe_rules(prefix: str, **kw) -> list[Rule]:
    """Router, selection bias, experts (per-expert or stacked) and shared experts under ``prefix``."""
    return moe_rules(prefix, shared="shared_experts", expert_bias=kw.pop("expert_bias", "gate.e_score_correction_bias"),
                     **kw)


# ---- layers ---------------------------------------------------------------------------------

MLP_LETTERS = {"dense": "d", "sparse": "e"}


def mlp_letters(hf: dict, dense_default: int) -> list[str]:
    """'d'/'e' per layer from ``mlp_layer_types``, else the first ``first_k_dense_replace`` dense."""
    n = hf_get(hf, "num_hidden_layers")
    types = hf.get("mlp_layer_types")
    if types is None:
        k = hf.get("first_k_dense_replace")
        k = dense_default if k is None else k
        return ["d" if i < k else "e" for i in range(n)]
    bad = [t for t in types if t not in MLP_LETTERS]
    if len(types) != n or bad:
        raise CheckpointError(f"config.json: mlp_layer_types={types} must give one of {list(MLP_LETTERS)} for each "
                              f"of num_hidden_layers={n} layers")
    return [MLP_LETTERS[t] for t in types]


def mlp_types_to_hf(cfg: ModelConfig, out: dict) -> None:
    kinds = cfg.parsed_layout().layers
    out["mlp_layer_types"] = ["dense" if k.mlp == "d" else "sparse" for k in kinds]
    out["first_k_dense_replace"] = next((i for i, k in enumerate(kinds) if k.mlp == "e"), len(kinds))


def check_silu(hf: dict) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported (allowed: silu)")


def base_model_config(hf: dict, layout: str, scaling_default: float, **sections) -> ModelConfig:
    """The fields every family here reads the same way (``sections``: the mixers' configs)."""
    check_silu(hf)
    max_len = hf.get("max_position_embeddings") or hf.get("model_max_length") or 4096
    return ModelConfig(vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"), layout=layout,
                       mlp=MLPConfig(ffn_hidden_size=hf_get(hf, "intermediate_size")),
                       moe=moe_from_hf(hf, scaling_default) if "e" in layout else None,
                       norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       max_seq_len=max_len, params_dtype=dtype_name(hf), **sections)


def base_to_hf(cfg: ModelConfig, original: dict | None, model_type: str, architecture: str, spelling: int = 0) -> dict:
    out = base_hf_config(cfg, original, model_type, architecture)
    out.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.parsed_layout().num_layers,
               rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
               intermediate_size=cfg.mlp.ffn_hidden_size)
    if cfg.moe is not None:
        moe_to_hf(cfg, out, model_type, spelling)
    return out


def mtp_skipped(hf: dict, names: set[str], prefix: str = "model.layers.") -> tuple[set[str], str]:
    """For a family that does not convert them (kimi_k25): the ``num_nextn_predict_layers``
    multi-token-prediction layers after the last decoder layer are left out, as transformers
    leaves them (later layers still fail). The others convert them (megamoe.convert.mtp)."""
    n, extra = hf_get(hf, "num_hidden_layers"), hf.get("num_nextn_predict_layers") or 0
    layer = re.compile(rf"^{re.escape(prefix)}(\d+)\.")
    mtp = {x for x in names if (m := layer.match(x)) and n <= int(m.group(1)) < n + extra}
    return mtp, (f"multi-token-prediction layers {n}..{n + extra - 1} are not converted (transformers ignores "
                 f"them too)" if mtp else "")


MTP_TYPES = {"full_attention": "M"}  # the MTP layer's mixer by HF layer type (megamoe.convert.mtp)


# ---- deepseek_v3 ------------------------------------------------------------------------------

def config_from_hf(hf: dict) -> ModelConfig:
    layout = "".join("M" + m for m in mlp_letters(hf, dense_default=3))
    rope = "interleaved" if hf.get("rope_interleave", True) else "half"
    cfg = base_model_config(hf, layout, 2.5, mla=mla_from_hf(hf, rope=rope))
    cfg.mtp = mtp_from_hf(hf, NEXTN_KEY, MTP_TYPES, "M", cfg.moe is not None)
    return cfg


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out = base_to_hf(cfg, original, "deepseek_v3", "DeepseekV3ForCausalLM")
    kinds = cfg.parsed_layout().layers
    dense = next((i for i, k in enumerate(kinds) if k.mlp == "e"), len(kinds))
    expressible(all(str(k) == ("Md" if i < dense else "Me") for i, k in enumerate(kinds)), "deepseek_v3", "layout",
                cfg.layout, "MLA layers, first_k_dense_replace dense MLPs, then experts")
    out["first_k_dense_replace"] = dense
    rope = cfg.mla.rope
    expressible(rope != "none", "deepseek_v3", "mla.rope", rope, "deepseek_v3 rotates (interleaved or half)")
    mla_to_hf(cfg, out, "deepseek_v3", rope=rope)
    out["rope_interleave"] = rope == "interleaved"
    mtp_to_hf(cfg, out, NEXTN_KEY, MTP_TYPES, "M")
    return out


def text_rules(cfg: ModelConfig, model: str = "model.", head: str = "lm_head.weight", layers: str = "layers"
               ) -> list[Rule]:
    """The deepseek_v3 text model with its modules under ``model`` (kimi_k25 nests it)."""
    layer = f"{model}{layers}.{{L}}"
    return [*embedding_rules(cfg, prefix=model, head=head), *norm_rules(layer, "M"),
            *mla_rules(f"{layer}.self_attn", "M", cfg), *dense_mlp_rules(f"{layer}.mlp"),
            *deepseek_moe_rules(f"{layer}.mlp")]


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    return nextn_table(text_rules(cfg), cfg)


DEEPSEEK_V3 = register(Family("deepseek_v3", "DeepseekV3ForCausalLM", config_from_hf, config_to_hf, rules,
                              notes="MLA + sigmoid group-limited MoE with the aux-free expert bias; MTP layers",
                              weight_dtypes=WITH_FP8))
