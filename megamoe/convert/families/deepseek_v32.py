"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 with DeepSeek sparse attention, letter ``D``.

Every layer is MLA (interleaved RoPE, YaRN) whose keys a lightning indexer restricts to the
``index_topk`` best per query; the indexer's RoPE is rotate-half on its first qk_rope_head_dim
channels (layers/mixers/dsa.py). MLPs follow ``mlp_layer_types`` (dense/sparse) and the MoE is
DeepSeek-V3's (deepseek_v3.py). HF -> megamoe indexer names:

    indexer.wq_b -> indexer.linear_q     indexer.wk -> indexer.linear_k
    indexer.k_norm (LayerNorm weight, bias) -> indexer.k_norm      indexer.weights_proj -> indexer.linear_weights
"""
from __future__ import annotations

from megamoe.core.config import DSAConfig, ModelConfig
from megamoe.convert.families.common import dense_mlp_rules, embedding_rules, norm_rules
from megamoe.convert.families.deepseek_v3 import (base_model_config, base_to_hf, deepseek_moe_rules, expressible,
                                                  mla_from_hf, mla_rules, mla_to_hf, mlp_letters, mlp_types_to_hf)
from megamoe.convert.family import WITH_FP8, Family, hf_get, register
from megamoe.convert.mtp import NEXTN_KEY, mtp_from_hf, mtp_to_hf, nextn_table
from megamoe.convert.table import Rule, Same
from megamoe.core.errors import CheckpointError

MTP_TYPES = {"indexed_attention": "D"}  # the MTP layer's mixer by HF layer type (megamoe.convert.mtp)
INDEXER = {"linear_q.weight": "wq_b.weight", "linear_k.weight": "wk.weight", "k_norm.weight": "k_norm.weight",
           "k_norm.bias": "k_norm.bias", "linear_weights.weight": "weights_proj.weight"}


def indexer_from_hf(hf: dict) -> DSAConfig:
    return DSAConfig(num_heads=hf_get(hf, "index_n_heads", 64), head_dim=hf_get(hf, "index_head_dim", 128),
                     topk=hf_get(hf, "index_topk", 2048))


def indexer_rules(prefix: str, letters: str = "D") -> list[Rule]:
    return [Same(f"layers.{{L}}.mixer.indexer.{ours}", f"{prefix}.indexer.{theirs}", when=letters)
            for ours, theirs in INDEXER.items()]


def check_indexed(hf: dict, n: int, family: str) -> None:
    """Every one of the ``n`` layers MLA + DSA (``indexed_attention``), with a query latent (the
    indexer reads it): what deepseek_v32 and glm_moe_dsa checkpoints are."""
    types = hf.get("layer_types") or ["indexed_attention"] * n
    if set(types) != {"indexed_attention"} or len(types) != n:
        raise CheckpointError(f"config.json: layer_types={types} is not supported for {family} "
                              f"(every layer is 'indexed_attention')")
    if hf.get("q_lora_rank") is None:
        raise CheckpointError(f"config.json: q_lora_rank must be set for {family} (the indexer reads the "
                              "query latent)")


def indexed_to_hf(cfg: ModelConfig, out: dict, **per_layer) -> dict:
    """``out`` with the indexer's keys, every layer ``indexed_attention`` (``per_layer``: further
    per-layer lists), the MLP types and the MTP layers."""
    idx, n = cfg.mla.indexer, len(cfg.parsed_layout().layers)
    out.update(index_n_heads=idx.num_heads, index_head_dim=idx.head_dim, index_topk=idx.topk,
               layer_types=["indexed_attention"] * n, **per_layer)
    mlp_types_to_hf(cfg, out)
    mtp_to_hf(cfg, out, NEXTN_KEY, MTP_TYPES, "D")
    return out


def indexed_rules(cfg: ModelConfig, mixers: str, indexed: str = "D") -> list[Rule]:
    """The table of an MLA + DSA model whose ``mixers`` letters are MLA layers, the ``indexed``
    ones with their own indexer; DeepSeek's MLPs; MTP layers."""
    layer = "model.layers.{L}"
    return nextn_table([*embedding_rules(cfg), *norm_rules(layer, mixers),
                        *mla_rules(f"{layer}.self_attn", mixers, cfg), *indexer_rules(f"{layer}.self_attn", indexed),
                        *dense_mlp_rules(f"{layer}.mlp"), *deepseek_moe_rules(f"{layer}.mlp")], cfg)


def config_from_hf(hf: dict) -> ModelConfig:
    letters = mlp_letters(hf, dense_default=3)
    check_indexed(hf, len(letters), "deepseek_v32")
    mla = mla_from_hf(hf, rope="interleaved", indexer=indexer_from_hf(hf))
    cfg = base_model_config(hf, "".join("D" + m for m in letters), 2.5, mla=mla)
    cfg.mtp = mtp_from_hf(hf, NEXTN_KEY, MTP_TYPES, "D", cfg.moe is not None)
    return cfg


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out = base_to_hf(cfg, original, "deepseek_v32", "DeepseekV32ForCausalLM")
    kinds = cfg.parsed_layout().layers
    expressible(all(k.mixer == "D" for k in kinds), "deepseek_v32", "layout", cfg.layout, "every mixer is D")
    idx = cfg.mla.indexer
    expressible(idx.kpool == 1, "deepseek_v32", "mla.indexer.kpool", idx.kpool, "no pooled keys")
    mla_to_hf(cfg, out, "deepseek_v32", rope="interleaved")
    return indexed_to_hf(cfg, out)


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    return indexed_rules(cfg, "D")


DEEPSEEK_V32 = register(Family("deepseek_v32", "DeepseekV32ForCausalLM", config_from_hf, config_to_hf, rules,
                               notes="deepseek_v3 + DSA lightning indexer (letter D); MTP layers",
                               weight_dtypes=WITH_FP8))
