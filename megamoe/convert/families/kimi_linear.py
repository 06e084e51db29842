"""Kimi Linear (``kimi_linear``): KDA (letter ``K``) and MLA without RoPE (``M``, the k_rope
channels used as they are) per ``layer_types``; dense SwiGLU or DeepSeek-style MoE per
``mlp_layer_types`` (sigmoid, group-limited, ``e_score_correction_bias`` -> ``router.expert_bias``,
routed scaling, shared experts; see deepseek_v3.py).

``save_pretrained`` writes the hub checkpoint's names, transformers keeps others in memory
(written with ``save_original_format=False``); both import, exports write the hub names:

    hub (default save)                                    in memory
    self_attn.q_conv1d / k_conv1d / v_conv1d [W, 1, K]    self_attn.conv1d [3W, 1, K]
    self_attn.A_log [1, 1, H, 1], dt_bias, f_a_proj,      self_attn.forget_gate.A_log, .dt_bias, ...
      f_b_proj
    block_sparse_moe.{gate_proj, up_proj, down_proj}       mlp.{...}              (dense layers)
    block_sparse_moe.gate, .shared_experts,                mlp.gate, .shared_experts,
      .experts.{E}.w1 / w3 / w2 (gate / up / down)          .experts.gate_up_proj / .down_proj

KDA -> megamoe (megamoe/convert/hf_layout.py): q_proj, k_proj, v_proj, b_proj -> in_proj;
conv weights -> conv_weight [3W, K]; f_a_proj / f_b_proj -> forget_gate.down / .up; g_a_proj /
g_b_proj -> output_gate.down / .up; o_norm -> norm; o_proj -> out_proj.

Also ``kda_rules``, ``layer_types_to_letters`` and ``hybrid_to_hf``, which bailing_hybrid shares.
"""
from __future__ import annotations

import torch

from megamoe.core.config import KDAConfig, ModelConfig
from megamoe.convert.families.common import dense_mlp_rules, embedding_rules, norm_rules
from megamoe.convert.families.deepseek_v3 import (base_model_config, base_to_hf, deepseek_moe_rules, expressible,
                                                  mla_from_hf, mla_rules, mla_to_hf, mlp_letters, mlp_types_to_hf)
from megamoe.convert.family import Family, hf_get, register
from megamoe.convert.table import Fn, Rule, Same, alternatives
from megamoe.core.errors import CheckpointError
from megamoe.convert import hf_layout

MIXER_LETTERS = {"linear_attention": "K", "full_attention": "M"}


def layer_types_to_letters(types: list[str], n: int) -> list[str]:
    bad = [t for t in types if t not in MIXER_LETTERS]
    if len(types) != n or bad:
        raise CheckpointError(f"config.json: layer_types={types} must give one of {list(MIXER_LETTERS)} for each of "
                              f"num_hidden_layers={n} layers")
    return [MIXER_LETTERS[t] for t in types]


def letters_to_layer_types(cfg: ModelConfig, model_type: str) -> list[str]:
    kinds = cfg.parsed_layout().layers
    expressible(all(k.mixer in "KM" for k in kinds), model_type, "layout", cfg.layout, "mixers are K or M")
    return ["linear_attention" if k.mixer == "K" else "full_attention" for k in kinds]


# ---- KDA rules -----------------------------------------------------------------------------

def _cat_conv(t, ctx):
    return hf_layout.conv_from_hf(torch.cat(t, dim=0))


def _split_conv(w, ctx):
    return hf_layout.conv_to_hf(w).chunk(3, dim=0)


def _in_proj(t, ctx):
    return hf_layout.kda_to_in_proj(*t)


def _split_in_proj(w, ctx):
    return hf_layout.in_proj_to_kda(w, ctx.cfg.kda.num_heads, ctx.cfg.kda.head_dim)


def kda_rules(prefix: str, *, forget: str, split_conv: bool, a_log_shape: tuple[int, ...], low_rank: bool,
              o_proj: str = "o_proj", letters: str = "K") -> list[Rule]:
    """KDA (layers/mixers/kda.py) from one HF layout: ``forget`` is the forget gate's
    module under ``prefix`` ('' or 'forget_gate.'), ``split_conv`` whether q/k/v convolutions are
    separate tensors, ``a_log_shape`` how HF shapes A_log ([H] in megamoe), ``low_rank`` the
    f_a/f_b and g_a/g_b gates (else full-rank f_proj and g_proj)."""
    m, f = "layers.{L}.mixer", f"{prefix}.{forget}"
    convs = tuple(f"{prefix}.{x}_conv1d.weight" for x in "qkv") if split_conv else (f"{prefix}.conv1d.weight",)
    rules: list[Rule] = [
        Fn(f"{m}.in_proj.weight", tuple(f"{prefix}.{x}_proj.weight" for x in "qkvb"), when=letters,
           forward=_in_proj, backward=_split_in_proj),
        Fn(f"{m}.conv_weight", convs, when=letters, forward=_cat_conv if split_conv else
           (lambda t, ctx: hf_layout.conv_from_hf(t[0])), backward=_split_conv if split_conv else
           (lambda w, ctx: hf_layout.conv_to_hf(w))),
        Fn(f"{m}.A_log", (f"{f}A_log",), when=letters, forward=lambda t, ctx: t[0].reshape(-1),
           backward=lambda w, ctx: w.reshape(a_log_shape)),
        Same(f"{m}.dt_bias", f"{f}dt_bias", when=letters),
    ]
    if low_rank:
        gates = {"forget_gate.down": f"{f}f_a_proj", "forget_gate.up": f"{f}f_b_proj",
                 "output_gate.down": f"{prefix}.g_a_proj", "output_gate.up": f"{prefix}.g_b_proj"}
    else:
        gates = {"forget_gate.up": f"{f}f_proj", "output_gate.up": f"{prefix}.g_proj"}
    gates.update({"norm": f"{prefix}.o_norm", "out_proj": f"{prefix}.{o_proj}"})
    return rules + [Same(f"{m}.{ours}.weight", f"{theirs}.weight", when=letters) for ours, theirs in gates.items()]


# ---- kimi_linear ----------------------------------------------------------------------------

def kda_from_hf(hf: dict) -> KDAConfig:
    """Head sizes from ``linear_attn_config`` (the hub config) over ``linear_*`` (transformers')."""
    lin = hf.get("linear_attn_config") or {}
    return KDAConfig(num_heads=lin.get("num_heads") or hf.get("linear_num_heads") or 32,
                     head_dim=lin.get("head_dim") or hf.get("linear_head_dim") or 128,
                     conv_kernel=lin.get("short_conv_kernel_size") or hf.get("linear_conv_kernel_dim") or 4)


def kimi_layer_types(hf: dict, n: int) -> list[str]:
    """``layer_types``, else the hub's 1-indexed kda_layers / full_attn_layers, else transformers'
    default (every fourth layer from the fifth is full attention)."""
    if hf.get("layer_types"):
        return hf["layer_types"]
    lin = hf.get("linear_attn_config") or {}
    if "kda_layers" in lin and "full_attn_layers" in lin:
        types = [None] * n
        for i in lin["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            types[i - 1] = "linear_attention"
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def config_from_hf(hf: dict) -> ModelConfig:
    n = hf_get(hf, "num_hidden_layers")
    mixers = layer_types_to_letters(kimi_layer_types(hf, n), n)
    layout = "".join(a + b for a, b in zip(mixers, mlp_letters(hf, dense_default=1)))
    sections = {"kda": kda_from_hf(hf)} if "K" in layout else {}
    if "M" in layout:
        sections["mla"] = mla_from_hf(hf, rope="none")
    return base_model_config(hf, layout, 2.446, **sections)


def hybrid_to_hf(cfg: ModelConfig, original: dict | None, model_type: str, architecture: str,
                 **mla) -> tuple[dict, list[str]]:
    """What kimi_linear and bailing_hybrid write alike: the MoE (their key spelling), layer_types,
    mlp_layer_types and the MLA (``mla``: mla_to_hf's options). Returns (config, layer_types)."""
    out = base_to_hf(cfg, original, model_type, architecture, spelling=1)
    types = letters_to_layer_types(cfg, model_type)
    out["layer_types"] = types
    mlp_types_to_hf(cfg, out)
    if cfg.mla is not None and "full_attention" in types:
        mla_to_hf(cfg, out, model_type, **mla)
    return out, types


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out, types = hybrid_to_hf(cfg, original, "kimi_linear", "KimiLinearForCausalLM", rope="none")
    if cfg.kda is not None and "linear_attention" in types:
        k = cfg.kda
        for field, ok in (("gate_rank", k.gate_rank in (None, k.head_dim)),
                          ("gate_lower_bound", k.gate_lower_bound is None),
                          ("norm_eps", k.norm_eps in (None, cfg.norm_eps))):
            expressible(ok, "kimi_linear", f"kda.{field}", getattr(k, field),
                        "kimi_linear's KDA has low-rank softplus gates and rms_norm_eps")
        out.update(linear_num_heads=k.num_heads, linear_head_dim=k.head_dim, linear_conv_kernel_dim=k.conv_kernel)
        # transformers reads head sizes from the hub's linear_attn_config first: keep it consistent
        out["linear_attn_config"] = {**(out.get("linear_attn_config") or {}), "num_heads": k.num_heads,
                                     "head_dim": k.head_dim, "short_conv_kernel_size": k.conv_kernel,
                                     "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
                                     "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"]}
    return out


def kimi_rules(layer: str, cfg: ModelConfig, *, hub: bool) -> list[Rule]:
    """The layer tensors in the hub layout (``hub``) or transformers' in-memory one."""
    attn, mlp = f"{layer}.self_attn", f"{layer}.block_sparse_moe" if hub else f"{layer}.mlp"
    rules = kda_rules(attn, forget="" if hub else "forget_gate.", split_conv=hub, a_log_shape=(1, 1, -1, 1),
                      low_rank=True) if cfg.kda is not None else []
    moe = deepseek_moe_rules(mlp, expert_names=("w1", "w3", "w2")) if hub else deepseek_moe_rules(mlp)
    return rules + dense_mlp_rules(mlp) + moe


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    layer = "model.layers.{L}"
    mla = mla_rules(f"{layer}.self_attn", "M", cfg) if cfg.mla is not None else []
    return [*embedding_rules(cfg), *norm_rules(layer, "KM"), *mla,
            *alternatives(kimi_rules(layer, cfg, hub=True), kimi_rules(layer, cfg, hub=False))]


KIMI_LINEAR = register(Family("kimi_linear", "KimiLinearForCausalLM", config_from_hf, config_to_hf, rules,
                              notes="KDA + NoPE MLA + DeepSeek-style MoE; hub and in-memory names"))
