"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's MLA + DSA with GLM's cross-layer index sharing.

Each layer's ``indexer_types`` entry picks its mixer letter: ``full`` runs the layer's own
lightning indexer (letter ``D``, indexer RoPE on interleaved pairs: ``mla.indexer.rope``),
``shared`` has no indexer and attends over the selection of the previous full layer (letter
``R``). MLA rotates interleaved pairs as DeepSeek-V3 does; MLPs follow ``mlp_layer_types``
(``first_k_dense_replace`` dense layers, then DeepSeek's MoE: sigmoid scores, group-limited
top-k, the selection bias, renormalised weights times ``routed_scaling_factor``, one shared
expert). The indexer's tensors are deepseek_v32's (``indexer_rules``).

Hub configs may give the indexer schedule as ``index_topk_pattern`` ("FSS..."), or as
``index_topk_freq`` / ``index_skip_topk_offset``, instead of ``indexer_types``; they are read
the way transformers reads them. The multi-token-prediction layers the hub checkpoints append
(``model.layers.{num_hidden_layers}``: an MLA + DSA layer with its own indexer and routed experts,
``De``) convert both ways (megamoe.convert.mtp), where transformers skips them.
"""
from __future__ import annotations

from megamoe.core.config import ModelConfig
from megamoe.convert.families.deepseek_v3 import (base_model_config, base_to_hf, expressible, mla_from_hf, mla_to_hf,
                                                  mlp_letters)
from megamoe.convert.families.deepseek_v32 import (MTP_TYPES, check_indexed, indexed_rules, indexed_to_hf,
                                                   indexer_from_hf)
from megamoe.convert.family import WITH_FP8, Family, hf_get, register
from megamoe.convert.mtp import NEXTN_KEY, mtp_from_hf
from megamoe.convert.table import Rule
from megamoe.core.errors import CheckpointError

LETTERS = {"full": "D", "shared": "R"}


def indexer_types(hf: dict) -> list[str]:
    """``full``/``shared`` per layer: ``indexer_types``, else the pattern or the freq/offset schedule."""
    n = hf_get(hf, "num_hidden_layers")
    types = hf.get("indexer_types")
    if types is None and hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq, offset = max(hf.get("index_topk_freq") or 1, 1), hf.get("index_skip_topk_offset")
        offset = 2 if offset is None else offset
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    bad = [t for t in types if t not in LETTERS]
    if len(types) != n or bad:
        raise CheckpointError(f"config.json: indexer_types={types} must give one of {list(LETTERS)} for each of "
                              f"num_hidden_layers={n} layers")
    if types[0] != "full":
        raise CheckpointError(f"config.json: indexer_types[0]={types[0]!r} is not supported (a shared layer reuses "
                              "the selection of an earlier full one)")
    return list(types)


def config_from_hf(hf: dict) -> ModelConfig:
    mlps = mlp_letters(hf, dense_default=3)
    check_indexed(hf, len(mlps), "glm_moe_dsa")
    indexer = indexer_from_hf(hf)
    indexer.rope = "interleaved"
    mla = mla_from_hf(hf, rope="interleaved", indexer=indexer)
    layout = "".join(LETTERS[t] + m for t, m in zip(indexer_types(hf), mlps))
    cfg = base_model_config(hf, layout, 2.5, mla=mla)
    cfg.mtp = mtp_from_hf(hf, NEXTN_KEY, MTP_TYPES, "D", cfg.moe is not None)  # its own indexer
    return cfg


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    out = base_to_hf(cfg, original, "glm_moe_dsa", "GlmMoeDsaForCausalLM")
    kinds = cfg.parsed_layout().layers
    expressible(all(k.mixer in "DR" for k in kinds), "glm_moe_dsa", "layout", cfg.layout, "every mixer is D or R")
    idx = cfg.mla.indexer
    expressible(idx.kpool == 1, "glm_moe_dsa", "mla.indexer.kpool", idx.kpool, "no pooled keys")
    expressible(idx.rope == "interleaved", "glm_moe_dsa", "mla.indexer.rope", idx.rope, "GLM-5 interleaves")
    mla_to_hf(cfg, out, "glm_moe_dsa", rope="interleaved")
    for key in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"):
        out.pop(key, None)  # indexer_types below says it all
    return indexed_to_hf(cfg, out, indexer_types=["full" if k.mixer == "D" else "shared" for k in kinds])


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    return indexed_rules(cfg, "DR")


GLM_MOE_DSA = register(Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", config_from_hf, config_to_hf, rules,
                              notes="GLM-5: MLA + DSA (letter D, interleaved indexer RoPE), shared-indexer layers "
                                    "(letter R), DeepSeek MoE; MTP layers",
                              weight_dtypes=WITH_FP8))
