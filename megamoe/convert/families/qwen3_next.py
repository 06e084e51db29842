"""Qwen3-Next (``qwen3_next``): Gated DeltaNet (``G``) and gated softmax attention (``A``: sigmoid
output gate from q_proj, partial rotary, QK-norm), MoE with one shared expert behind a sigmoid
gate; zero-centred RMSNorms ``(1 + w)`` everywhere except GDN's gated output norm (plain ``w``).

Layout: mixers from ``layer_types`` (linear_attention -> G, full_attention -> A), MLPs from
``decoder_sparse_step``/``mlp_only_layers`` (see qwen3_moe.mlp_letters). GDN's fused
``in_proj_qkvz``/``in_proj_ba`` (per-key-head interleave) map onto megamoe's ``in_proj`` with
the typed transforms of ``megamoe.convert.hf_layout``. The builders here are
shared with qwen3_5_moe (separate GDN projections, nested text config, M-RoPE).
"""
from __future__ import annotations

from megamoe.core.config import AttentionConfig, GDNConfig, MLPConfig, ModelConfig, MoEConfig
from megamoe.convert.family import Family, hf_get, register
from megamoe.convert.mtp import QWEN_KEY, check_single_qwen_depth, mtp_from_hf, mtp_to_hf, qwen_table
from megamoe.convert.families.common import (attention_rules, base_hf_config, dense_mlp_rules, dtype_name,
                                             embedding_rules, moe_rules, norm_rules)
from megamoe.convert.families.qwen3 import attention_from_hf, attention_to_hf, common_to_hf
from megamoe.convert.families.qwen3_moe import (check_moe_routing, mlp_letters, moe_from_hf, moe_to_hf,
                                                sparse_layout_to_hf)
from megamoe.convert.table import Fn, Rule, Same
from megamoe.core.errors import CheckpointError
from megamoe.convert import hf_layout as L

MIXER_TYPES = {"linear_attention": "G", "full_attention": "A"}


# ---- HF config -> ModelConfig ----------------------------------------------------------------

def mixer_letters(hf: dict, model_type: str) -> list[str]:
    types = hf_get(hf, "layer_types")
    unknown = [t for t in types if t not in MIXER_TYPES]
    if unknown:
        raise CheckpointError(f"config.json: layer_types entry {unknown[0]!r} is not supported for {model_type} "
                              f"(allowed: {', '.join(MIXER_TYPES)})")
    if len(types) != hf_get(hf, "num_hidden_layers"):
        raise CheckpointError(f"config.json: layer_types has {len(types)} entries for "
                              f"num_hidden_layers={hf['num_hidden_layers']}")
    return [MIXER_TYPES[t] for t in types]


def gated_attention_from_hf(hf: dict) -> AttentionConfig:
    """Gated GQA with QK-norm and partial rotary (HF's default factor for these families: 0.25)."""
    rope = hf.get("rope_parameters") or {}
    attention = attention_from_hf(hf, output_gate=True)  # RoPE type default or yarn
    attention.partial_rotary_factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    return attention


def gdn_from_hf(hf: dict) -> GDNConfig:
    return GDNConfig(num_key_heads=hf_get(hf, "linear_num_key_heads"), num_value_heads=hf_get(hf, "linear_num_value_heads"),
                     key_head_dim=hf_get(hf, "linear_key_head_dim"), value_head_dim=hf_get(hf, "linear_value_head_dim"),
                     conv_kernel=hf_get(hf, "linear_conv_kernel_dim"))


def shared_moe_from_hf(hf: dict) -> MoEConfig:
    """Softmax top-k routed experts plus one shared expert scaled by sigmoid(x W_g)."""
    return moe_from_hf(hf, num_shared_experts=1, shared_expert_gate=True,
                       shared_expert_ffn_hidden_size=hf_get(hf, "shared_expert_intermediate_size"))


def hybrid_config(hf: dict, model_type: str, mlps: list[str], **kw) -> ModelConfig:
    """The ModelConfig of a Qwen3-Next-style text config (``mlps``: 'e'/'d' per layer)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported for {model_type} "
                              f"(allowed: silu)")
    layout = "".join(m + p for m, p in zip(mixer_letters(hf, model_type), mlps))
    ffn = hf_get(hf, "intermediate_size") if "d" in mlps else hf.get("intermediate_size")
    mlp = MLPConfig(ffn_hidden_size=ffn) if ffn else MLPConfig()  # kept for the export when all MLPs are MoE
    cfg = ModelConfig(vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"), layout=layout,
                      attention=gated_attention_from_hf(hf), mlp=mlp, gdn=gdn_from_hf(hf),
                      moe=shared_moe_from_hf(hf) if "e" in mlps else None, norm_zero_centered=True,
                      norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings")),
                      max_seq_len=hf.get("max_position_embeddings", 4096), params_dtype=dtype_name(hf),
                      mtp=mtp_from_hf(hf, QWEN_KEY, MIXER_TYPES, "A", "e" in mlps), **kw)
    check_single_qwen_depth(cfg, model_type)
    return cfg


def config_from_hf(hf: dict) -> ModelConfig:
    return hybrid_config(hf, "qwen3_next", mlp_letters(hf))


# ---- ModelConfig -> HF config ----------------------------------------------------------------

def check_exportable(cfg: ModelConfig, model_type: str, mlps: str) -> None:
    """What the HF classes can express: an export must never silently change the model."""
    kinds = cfg.parsed_layout().layers
    bad = next((str(k) for k in kinds if k.mixer not in "GA" or k.mlp not in mlps), None)
    a, m = cfg.attention, cfg.moe
    problems = [
        (bad is not None, f"model.layout layer {bad!r} (allowed mixers G, A; MLPs {', '.join(mlps)})"),
        (not cfg.norm_zero_centered, "model.norm_zero_centered must be true"),
        (not (a.qk_norm and a.output_gate), "model.attention needs qk_norm and output_gate"),
        (cfg.gdn is not None and cfg.gdn.norm_zero_centered, "model.gdn.norm_zero_centered must be false"),
        (m is not None and (m.num_shared_experts != 1 or not m.shared_expert_gate),
         "model.moe needs one gated shared expert"),
    ]
    for failed, what in problems:
        if failed:
            raise CheckpointError(f"export to {model_type}: {what}")
    if m is not None:
        check_moe_routing(cfg, model_type)


def hybrid_to_hf(cfg: ModelConfig, out: dict) -> None:
    """Fields shared by qwen3_next and qwen3_5_moe's text config."""
    common_to_hf(cfg, out)
    attention_to_hf(cfg, out)
    out["rope_parameters"]["partial_rotary_factor"] = cfg.attention.partial_rotary_factor
    g = cfg.gdn or GDNConfig()
    out.update(hidden_act="silu", linear_num_key_heads=g.num_key_heads, linear_num_value_heads=g.num_value_heads,
               linear_key_head_dim=g.key_head_dim, linear_value_head_dim=g.value_head_dim,
               linear_conv_kernel_dim=g.conv_kernel,
               layer_types=["linear_attention" if k.mixer == "G" else "full_attention"
                            for k in cfg.parsed_layout().layers])
    if cfg.moe is not None:
        moe_to_hf(cfg.moe, out)
        out.update(moe_intermediate_size=cfg.moe.moe_ffn_hidden_size,
                   shared_expert_intermediate_size=cfg.moe.shared_ffn())
    mtp_to_hf(cfg, out, QWEN_KEY, MIXER_TYPES, "A")


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    check_exportable(cfg, "qwen3_next", "ed")
    out = base_hf_config(cfg, original, "qwen3_next", "Qwen3NextForCausalLM")
    hybrid_to_hf(cfg, out)
    out["intermediate_size"] = cfg.mlp.ffn_hidden_size
    if cfg.moe is None:
        out["num_experts"] = 0
    sparse_layout_to_hf(cfg, out)
    return out


# ---- mapping table ---------------------------------------------------------------------------

def _shapes(ctx) -> L.GDNShapes:
    return L.GDNShapes.from_config(ctx.cfg.gdn)


def gdn_rules(prefix: str, fused: bool) -> list[Rule]:
    """GDN (layers/mixers/gdn.py) from HF ``linear_attn``: fused in_proj_qkvz + in_proj_ba
    (Qwen3-Next) or separate in_proj_qkv, _z, _b, _a (Qwen3.5); conv1d [C, 1, K] -> [C, K]."""
    mixer = "layers.{L}.mixer"
    if fused:
        in_proj = Fn(f"{mixer}.in_proj.weight", (f"{prefix}.in_proj_qkvz.weight", f"{prefix}.in_proj_ba.weight"),
                     when="G", forward=lambda t, ctx: L.qwen3_next_to_in_proj(*t, _shapes(ctx)),
                     backward=lambda w, ctx: L.in_proj_to_qwen3_next(w, _shapes(ctx)))
    else:
        in_proj = Fn(f"{mixer}.in_proj.weight", tuple(f"{prefix}.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
                     when="G", forward=lambda t, ctx: L.qwen3_5_to_in_proj(*t, _shapes(ctx)),
                     backward=lambda w, ctx: L.in_proj_to_qwen3_5(w, _shapes(ctx)))
    return [in_proj,
            Fn(f"{mixer}.conv_weight", (f"{prefix}.conv1d.weight",), when="G",
               forward=lambda t, ctx: L.conv_from_hf(t[0]), backward=lambda w, ctx: L.conv_to_hf(w)),
            *(Same(f"{mixer}.{n}", f"{prefix}.{n}", when="G") for n in ("A_log", "dt_bias", "norm.weight",
                                                                         "out_proj.weight"))]


def hybrid_rules(cfg: ModelConfig, prefix: str, fused_gdn: bool, head: str = "lm_head.weight") -> list[Rule]:
    """Text backbone of qwen3_next / qwen3_5_moe under ``prefix`` (e.g. ``model.``)."""
    layer = prefix + "layers.{L}"
    rules = [*embedding_rules(cfg, prefix, head), *norm_rules(layer, "GA"), *attention_rules(f"{layer}.self_attn", "A"),
             *gdn_rules(f"{layer}.linear_attn", fused_gdn), *dense_mlp_rules(f"{layer}.mlp"),
             *moe_rules(f"{layer}.mlp", shared="shared_expert", shared_gate="shared_expert_gate")]
    return qwen_table(rules, cfg, layer, "qwen")  # the MTP module (top-level mtp.*), if any


def rules(cfg: ModelConfig, hf: dict):
    return hybrid_rules(cfg, "model.", fused_gdn=True)


QWEN3_NEXT = register(Family("qwen3_next", "Qwen3NextForCausalLM", config_from_hf, config_to_hf, rules,
                             notes="Gated DeltaNet + gated attention, MoE with a gated shared expert"))
