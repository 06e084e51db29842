"""DeepSeek-V4 (``deepseek_v4``): compressed attention (letters ``W``, ``C``, ``H`` by
``layer_types``: sliding_attention, compressed_sparse_attention, heavily_compressed_attention),
hash-routed (``h``) then top-k (``e``) MoE by ``mlp_layer_types`` (``sqrtsoftplus`` scores,
selection bias on top-k layers, one shared expert of ``moe_intermediate_size``, every SwiGLU
clamped at ``swiglu_limit``), hyper-connections with the learned head (``hc_head``).

Three name layouts load (``OneOf``); exports write the first, what ``save_pretrained`` writes:

====================================  ===================================  ====================================
megamoe                               saved (hub names under ``model.``)    transformers in memory
====================================  ===================================  ====================================
layers.{L}.mixer.linear_q_down        layers.{L}.attn.wq_a                  self_attn.q_a_proj
mixer.q_norm / linear_q               attn.q_norm / attn.wq_b               self_attn.q_a_norm / q_b_proj
mixer.linear_kv / kv_norm             attn.wkv / attn.norm                  self_attn.kv_proj / kv_norm
mixer.sinks                           attn.attn_sink                        self_attn.sinks
mixer.linear_out_groups / linear_proj attn.wo_a / attn.wo_b                 self_attn.o_a_proj / o_b_proj
mixer.compressor.linear_kv_gate       attn.compressor.wkv | wgate           self_attn.compressor.kv_proj | gate_proj
mixer.compressor.position_bias, norm  attn.compressor.ape, norm             compressor.position_bias, kv_norm
mixer.indexer.compressor.*            attn.indexer.compressor.*             self_attn.compressor.indexer.*
mixer.indexer.linear_q, linear_weights attn.indexer.wq_b, weights_proj      compressor.indexer.q_b_proj, scorer.weights_proj
mixer_hc.fn|base|scale (mlp_hc.*)     hc_attn_fn|base|scale (hc_ffn_*)      attn_hc.* (ffn_hc.*)
input_norm / pre_mlp_norm             attn_norm / ffn_norm                  input_layernorm / post_attention_layernorm
mlp.router.weight / expert_bias       ffn.gate.weight / ffn.gate.bias       mlp.gate.weight / e_score_correction_bias
mlp.router.table ('h')                ffn.gate.tid2eid                      mlp.gate.tid2eid
mlp.experts.*                         ffn.experts.{E}.w1|w3, w2             mlp.experts.gate_up_proj, down_proj
mlp.shared_experts.*                  ffn.shared_experts.w1|w3, w2          mlp.shared_experts.gate|up|down_proj
stream_head.fn|base|scale             hc_head.hc_fn|hc_base|hc_scale        (the same)
====================================  ===================================  ====================================

The hub's own files lack the ``model.`` prefix and name the top tensors ``embed``, ``norm``,
``head``, ``hc_head_fn|base|scale``; they load too. Its multi-token-prediction layers (``mtp.*``),
which transformers does not build, are skipped with a notice.
"""
from __future__ import annotations

import torch

from megamoe.core.config import (CompressedAttentionConfig, DSAConfig, HyperConnectionConfig, ModelConfig, MoEConfig,
                                 SCORE_FUNCTIONS, YarnConfig)
from megamoe.convert.families.common import base_hf_config, dtype_name, type_letters
from megamoe.convert.families.deepseek_v3 import expressible
from megamoe.convert.family import Family, hf_get, register
from megamoe.convert.table import Cat, Experts, Rule, Same, alternatives
from megamoe.core.errors import CheckpointError

MIXERS = {"sliding_attention": "W", "compressed_sparse_attention": "C", "heavily_compressed_attention": "H"}
MLPS = {"hash_moe": "h", "moe": "e"}
TYPE_OF = {v: k for k, v in {**MIXERS, **MLPS}.items()}


# ---- config ---------------------------------------------------------------------------------

def _rope(hf: dict, kind: str) -> dict:
    params = hf.get("rope_parameters") or {}
    return params.get(kind) if isinstance(params.get(kind), dict) else {}


def yarn_from_v4(hf: dict) -> YarnConfig:
    """The compressed layers' YaRN (``rope_parameters.compress``); V4 leaves cos/sin unscaled."""
    p = _rope(hf, "compress") or {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind == "default":
        return YarnConfig()
    if kind != "yarn" or p.get("attention_factor", 1.0) != 1.0 or p.get("truncate", True) is False:
        raise CheckpointError(f"config.json: rope_parameters.compress={p} is not supported (allowed: default, or "
                              f"yarn with attention_factor 1 as DeepSeek-V4 uses)")
    original = p.get("original_max_position_embeddings") or hf_get(hf, "original_max_position_embeddings")
    return YarnConfig(factor=float(p["factor"]), original_max_position=int(original),
                      beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1))


LEGACY_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def layer_types(hf: dict, n: int) -> list[str]:
    """``layer_types``; else the hub's per-layer ``compress_ratios`` (0, 4, 128; the multi-token-prediction
    layers listed after the n decoder layers are dropped, as transformers drops them); else
    transformers' default (V4-Pro's): two HCA layers, then HCA and CSA alternating."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    ratios = hf.get("compress_ratios")
    if ratios is not None:
        bad = [r for r in ratios if r not in LEGACY_RATIOS]
        if bad:
            raise CheckpointError(f"config.json: compress_ratios has {bad[0]!r} (allowed: 0, 4, 128)")
        return [LEGACY_RATIOS[r] for r in list(ratios)[:n]]
    return ["heavily_compressed_attention"] * min(n, 2) + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]


def config_from_hf(hf: dict) -> ModelConfig:
    n = hf_get(hf, "num_hidden_layers")
    for key, want in (("num_key_value_heads", 1), ("hidden_act", "silu"), ("attention_bias", False)):
        if hf.get(key, want) != want:
            raise CheckpointError(f"config.json: {key}={hf[key]!r} is not supported for deepseek_v4 (allowed: {want!r})")
    mixers = type_letters(layer_types(hf, n), "layer_types", MIXERS, n)
    hashed = hf.get("num_hash_layers", 3)  # the hub's spelling of the first mlp_layer_types
    mlps = type_letters(hf.get("mlp_layer_types") or ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed),
                        "mlp_layer_types", MLPS, n)
    head_dim = hf_get(hf, "head_dim")
    rates = {"compressed_sparse_attention": hf.get("compress_rate_csa", 4),
             "heavily_compressed_attention": hf.get("compress_rate_hca", 128), **(hf.get("compress_rates") or {})}
    scoring = hf.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORE_FUNCTIONS:
        raise CheckpointError(f"config.json: scoring_func={scoring!r} is not supported (allowed: "
                              f"{', '.join(SCORE_FUNCTIONS)})")
    main = _rope(hf, "main")
    compressed = CompressedAttentionConfig(
        num_heads=hf_get(hf, "num_attention_heads"), head_dim=head_dim,
        rope_head_dim=int(hf.get("qk_rope_head_dim") or head_dim * float(hf.get("partial_rotary_factor") or 0.125)),
        q_lora_rank=hf_get(hf, "q_lora_rank"), o_groups=hf_get(hf, "o_groups"), o_lora_rank=hf_get(hf, "o_lora_rank"),
        sliding_window=hf_get(hf, "sliding_window"), rope_theta=float(main.get("rope_theta") or hf.get("rope_theta")
                                                                      or 10000.0),
        compress_rope_theta=float(_rope(hf, "compress").get("rope_theta") or hf.get("compress_rope_theta") or 160000.0),
        yarn=yarn_from_v4(hf), csa_rate=int(rates.get("compressed_sparse_attention", 4)),
        hca_rate=int(rates.get("heavily_compressed_attention", 128)),
        indexer=DSAConfig(num_heads=hf_get(hf, "index_n_heads"), head_dim=hf_get(hf, "index_head_dim"),
                          topk=hf_get(hf, "index_topk")))
    ffn = hf_get(hf, "moe_intermediate_size")
    limit = hf.get("swiglu_limit")
    # transformers' V4 router always renormalises the chosen weights and builds ONE shared expert
    moe = MoEConfig(num_experts=hf_get(hf, "n_routed_experts"), top_k=hf_get(hf, "num_experts_per_tok"),
                    moe_ffn_hidden_size=ffn, num_shared_experts=1, shared_expert_ffn_hidden_size=ffn,
                    score_function=scoring, norm_topk_prob=True,
                    routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0), expert_bias=True,
                    swiglu_limit=None if limit is None else float(limit))
    hc = HyperConnectionConfig(streams=hf_get(hf, "hc_mult"), sinkhorn_iters=hf_get(hf, "hc_sinkhorn_iters"),
                               eps=float(hf.get("hc_eps", 1e-6)), head="learned")
    return ModelConfig(vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"),
                       layout="".join(a + m for a, m in zip(mixers, mlps)), compressed=compressed, moe=moe,
                       hyper_connections=hc, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       max_seq_len=hf.get("max_position_embeddings") or 4096, params_dtype=dtype_name(hf))


def _check_expressible(cfg: ModelConfig) -> None:
    kinds = cfg.parsed_layout().layers
    expressible(all(k.mixer in "WCH" and k.mlp in "he" for k in kinds), "deepseek_v4", "layout", cfg.layout,
                "mixers W, C or H and MLPs h or e")
    hc, m, c = cfg.hyper_connections, cfg.moe, cfg.compressed
    expressible(hc is not None and hc.head == "learned" and hc.norm_eps in (None, cfg.norm_eps), "deepseek_v4",
                "hyper_connections", hc, "hyper-connections with the learned head, normalised with rms_norm_eps")
    for field, value, want in (("num_shared_experts", m.num_shared_experts, 1), ("norm_topk_prob", m.norm_topk_prob, True),
                               ("shared_expert_ffn_hidden_size", m.shared_ffn(), m.moe_ffn_hidden_size),
                               ("expert_bias", m.expert_bias, True), ("n_group", m.n_group, 1),
                               ("shared_expert_gate", m.shared_expert_gate, False)):
        expressible(value == want, "deepseek_v4", f"moe.{field}", value, f"deepseek_v4 has {want!r}")
    expressible(c.norm_eps in (None, cfg.norm_eps), "deepseek_v4", "compressed.norm_eps", c.norm_eps, "rms_norm_eps")
    expressible(c.indexer is not None, "deepseek_v4", "compressed.indexer", c.indexer, "C layers need the indexer")


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    _check_expressible(cfg)
    out = base_hf_config(cfg, original, "deepseek_v4", "DeepseekV4ForCausalLM")
    c, m, hc = cfg.compressed, cfg.moe, cfg.hyper_connections
    kinds = cfg.parsed_layout().layers
    compress = {"rope_type": "default", "rope_theta": c.compress_rope_theta,
                "partial_rotary_factor": c.rope_head_dim / c.head_dim}
    if c.yarn.factor > 1:
        compress.update(rope_type="yarn", factor=c.yarn.factor, attention_factor=1.0,
                        original_max_position_embeddings=c.yarn.original_max_position, beta_fast=c.yarn.beta_fast,
                        beta_slow=c.yarn.beta_slow)
    out.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=len(kinds),
               rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
               num_attention_heads=c.num_heads, num_key_value_heads=1, head_dim=c.head_dim,
               partial_rotary_factor=c.rope_head_dim / c.head_dim, q_lora_rank=c.q_lora_rank, o_groups=c.o_groups,
               o_lora_rank=c.o_lora_rank, sliding_window=c.sliding_window, rope_theta=c.rope_theta,
               compress_rope_theta=c.compress_rope_theta,
               compress_rates={"compressed_sparse_attention": c.csa_rate, "heavily_compressed_attention": c.hca_rate},
               index_n_heads=c.indexer.num_heads, index_head_dim=c.indexer.head_dim, index_topk=c.indexer.topk,
               rope_parameters={"main": {"rope_type": "default", "rope_theta": c.rope_theta,
                                         "partial_rotary_factor": c.rope_head_dim / c.head_dim}, "compress": compress},
               layer_types=[TYPE_OF[k.mixer] for k in kinds], mlp_layer_types=[TYPE_OF[k.mlp] for k in kinds],
               n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.moe_ffn_hidden_size,
               n_shared_experts=1, scoring_func=m.score_function, norm_topk_prob=True,
               routed_scaling_factor=m.routed_scaling_factor, swiglu_limit=m.swiglu_limit, hc_mult=hc.streams,
               hc_sinkhorn_iters=hc.sinkhorn_iters, hc_eps=hc.eps)
    out.setdefault("max_position_embeddings", cfg.max_seq_len)
    out.pop("qk_rope_head_dim", None)  # derived by transformers from partial_rotary_factor
    return out


def skipped(hf: dict, names: set[str]) -> tuple[set[str], str]:
    mtp = {x for x in names if x.startswith(("mtp.", "model.mtp."))}
    return mtp, ("multi-token-prediction layers (mtp.*) are not converted (transformers does not build them)"
                 if mtp else "")


# ---- table ----------------------------------------------------------------------------------

# (layer prefix, top-level names) of the three layouts
TOP = {"saved": ("model.layers.{L}", {"embedding.weight": "model.embed_tokens.weight", "head": "model.hc_head.hc_",
                                      "final_norm.weight": "model.norm.weight", "output_layer.weight": "head.weight"}),
       "hub": ("layers.{L}", {"embedding.weight": "embed.weight", "head": "hc_head_", "final_norm.weight": "norm.weight",
                              "output_layer.weight": "head.weight"}),
       "memory": ("model.layers.{L}", {"embedding.weight": "model.embed_tokens.weight", "head": "model.hc_head.hc_",
                                       "final_norm.weight": "model.norm.weight",
                                       "output_layer.weight": "lm_head.weight"})}
HUB_MIXER = {"linear_q_down": "wq_a", "q_norm": "q_norm", "linear_q": "wq_b", "linear_kv": "wkv", "kv_norm": "norm",
             "linear_out_groups": "wo_a", "linear_proj": "wo_b"}
MEMORY_MIXER = {"linear_q_down": "q_a_proj", "q_norm": "q_a_norm", "linear_q": "q_b_proj", "linear_kv": "kv_proj",
                "kv_norm": "kv_norm", "linear_out_groups": "o_a_proj", "linear_proj": "o_b_proj"}


def _compressor(ours: str, theirs: str, hub: bool, letters: str) -> list[Rule]:
    kv, gate, bias, norm = ("wkv", "wgate", "ape", "norm") if hub else ("kv_proj", "gate_proj", "position_bias", "kv_norm")
    return [Cat(f"{ours}.linear_kv_gate.weight", (f"{theirs}.{kv}.weight", f"{theirs}.{gate}.weight"), when=letters),
            Same(f"{ours}.position_bias", f"{theirs}.{bias}", when=letters),
            Same(f"{ours}.norm.weight", f"{theirs}.{norm}.weight", when=letters)]


def _layer_rules(layout: str) -> list[Rule]:
    hub = layout != "memory"
    layer = TOP[layout][0]
    attn, ffn = (f"{layer}.attn", f"{layer}.ffn") if hub else (f"{layer}.self_attn", f"{layer}.mlp")
    mx, all_ = "layers.{L}.mixer", "WCH"
    names = HUB_MIXER if hub else MEMORY_MIXER
    rules: list[Rule] = [Same(f"{mx}.{ours}.weight", f"{attn}.{theirs}.weight", when=all_) for ours, theirs in names.items()]
    rules.append(Same(f"{mx}.sinks", f"{attn}.{'attn_sink' if hub else 'sinks'}", when=all_))
    norms = ("attn_norm", "ffn_norm") if hub else ("input_layernorm", "post_attention_layernorm")
    rules += [Same("layers.{L}.input_norm.weight", f"{layer}.{norms[0]}.weight", when=all_),
              Same("layers.{L}.pre_mlp_norm.weight", f"{layer}.{norms[1]}.weight", when="eh")]
    for ours, block in (("mixer_hc", "attn"), ("mlp_hc", "ffn")):
        rules += [Same(f"layers.{{L}}.{ours}.{part}", f"{layer}.hc_{block}_{part}" if hub else
                       f"{layer}.{block}_hc.{part}", when=all_) for part in ("fn", "base", "scale")]
    rules += _compressor(f"{mx}.compressor", f"{attn}.compressor", hub, "CH")
    index = f"{attn}.indexer" if hub else f"{attn}.compressor.indexer"
    rules += _compressor(f"{mx}.indexer.compressor", f"{index}.compressor" if hub else index, hub, "C")
    rules += [Same(f"{mx}.indexer.linear_q.weight", f"{index}.{'wq_b' if hub else 'q_b_proj'}.weight", when="C"),
              Same(f"{mx}.indexer.linear_weights.weight",
                   f"{index}.{'weights_proj' if hub else 'scorer.weights_proj'}.weight", when="C")]
    return rules + _moe_rules(ffn, hub)


def _moe_rules(ffn: str, hub: bool) -> list[Rule]:
    mlp = "layers.{L}.mlp"
    gate, up, down = ("w1", "w3", "w2") if hub else ("gate_proj", "up_proj", "down_proj")
    e = f"{ffn}.experts.{{E}}"
    stacked = {} if hub else {"gate_up": (f"{ffn}.experts.gate_up_proj",), "down": (f"{ffn}.experts.down_proj",)}
    sh = f"{ffn}.shared_experts"
    return [Same(f"{mlp}.router.weight", f"{ffn}.gate.weight", when="eh"),
            Same(f"{mlp}.router.expert_bias", f"{ffn}.gate.{'bias' if hub else 'e_score_correction_bias'}", when="e"),
            Same(f"{mlp}.router.table", f"{ffn}.gate.tid2eid", when="h"),
            Experts(f"{mlp}.experts.gate_up_weight", (f"{e}.{gate}.weight", f"{e}.{up}.weight"), when="eh",
                    stacked=stacked.get("gate_up", ()), per_expert=lambda t, ctx: torch.cat(t, dim=0),
                    split_expert=lambda w, ctx: w.chunk(2, dim=0), row_blocks=True),
            Experts(f"{mlp}.experts.down_weight", (f"{e}.{down}.weight",), when="eh", stacked=stacked.get("down", ()),
                    per_expert=lambda t, ctx: t[0], split_expert=lambda w, ctx: [w], row_blocks=True),
            Cat(f"{mlp}.shared_experts.linear_fc1.weight", (f"{sh}.{gate}.weight", f"{sh}.{up}.weight"), when="eh"),
            Same(f"{mlp}.shared_experts.linear_fc2.weight", f"{sh}.{down}.weight", when="eh")]


def _top_rules(cfg: ModelConfig, layout: str) -> list[Rule]:
    top = TOP[layout][1]
    rules = [Same("embedding.weight", top["embedding.weight"]), Same("final_norm.weight", top["final_norm.weight"])]
    rules += [Same(f"stream_head.{part}", f"{top['head']}{part}") for part in ("fn", "base", "scale")]
    if not cfg.tie_embeddings:
        rules.append(Same("output_layer.weight", top["output_layer.weight"]))
    return rules


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    layouts = ("saved", "hub", "memory")
    return alternatives(*[_top_rules(cfg, x) + _layer_rules(x) for x in layouts])


DEEPSEEK_V4 = register(Family("deepseek_v4", "DeepseekV4ForCausalLM", config_from_hf, config_to_hf, rules,
                              notes="compressed sparse / heavily compressed attention, hash-routed then sqrtsoftplus "
                                    "MoE, hyper-connections with a learned head", skipped=skipped))
