"""MiniMax-M3-VL (``minimax_m3_vl``, ``MiniMaxM3SparseForConditionalGeneration``): a MiniMax-M2-like
text model with block-sparse attention layers under a native vision tower.

Text: ``layer_types`` give each layer's mixer (``full_attention`` -> ``A``, ``minimax_m3_sparse``
-> ``B``: ``attention.block_index`` from ``index_*``), ``mlp_layer_types`` its MLP (``dense``
-> ``d`` of ``dense_intermediate_size``, ``sparse`` -> ``e``). Attention has per-head
QK-norms; every RMSNorm is Gemma's ``(1 + w)`` (``model.norm_zero_centered``). RoPE rotates
``rope_parameters.partial_rotary_factor`` of each head, as transformers 5.25 does (it does
not read ``rotary_dim``). Every MLP is SwiGLU-OAI (``swiglu_alpha``, ``swiglu_limit``); the MoE
routes with sigmoid scores, the selection bias and renormalised weights, scales the routed
output by ``routed_scaling_factor`` and adds one shared expert (``shared_intermediate_size``).
Vision: ``minimax_m3_vit_enc`` (megamoe.vision.minimax_vit) and the ``mlp_merger`` projector
(megamoe.vision.hf_minimax).

Two HF name layouts load; exports write the first (what ``save_pretrained`` writes, the
released checkpoints' names, which transformers loads):

    hub (exported)                                  transformers' in-memory names       megamoe
    language_model.model.layers.{L}.self_attn.*     model.language_model.layers.{L}.*   layers.{L}.mixer.*
        index_q_proj, index_k_proj, index_*_norm        indexer.q_proj, k_proj, *_norm      indexer.linear_q, ...
        mlp.gate_proj + up_proj, down_proj (dense)      mlp.gate_up_proj, down_proj         mlp.linear_fc1, fc2
        block_sparse_moe.gate, e_score_correction_bias  mlp.gate.weight, gate.e_score_...   mlp.router.*
        block_sparse_moe.experts.{E}.w1/w3/w2           mlp.experts.gate_up_proj/down_proj  mlp.experts.*
        block_sparse_moe.shared_experts.gate/up/down    mlp.shared_experts.gate_up/down     mlp.shared_experts.*
    language_model.lm_head, model.embed_tokens, norm  lm_head, model.language_model.*     output_layer, ...
    vision_tower.vision_model.embeddings.patch_embedding  model.vision_tower.embeddings.proj  vision.encoder.model.patch_weight
    vision_tower.vision_model.pre_layrnorm          model.vision_tower.pre_layrnorm     ...norm_pre
    vision_tower.vision_model.encoder.layers.{B}.   model.vision_tower.layers.{B}.      ...blocks.{B}.
        layer_norm1|2, self_attn.q|k|v_proj, out_proj, mlp.fc1|2    norm1|2, attn.qkv (q, k rows permuted), attn.proj, mlp.*
    multi_modal_projector.linear_1|2                model.multi_modal_projector.*       vision.projector.patch.fc1|2
    patch_merge_mlp.linear_1|2                      ...multi_modal_projector.merge_linear_1|2  vision.projector.merge_fc1|2

Multi-token-prediction tensors (``mtp.*``) are skipped with a notice, as transformers skips them.
"""
from __future__ import annotations

import copy

import torch

from megamoe.core.config import BlockIndexConfig, MLPConfig, ModelConfig
from megamoe.convert.families.common import (attention_rules, base_hf_config, dtype_name, expert_rules,
                                             partial_rotary, text_config)
from megamoe.convert.families.deepseek_v3 import MLP_LETTERS, expressible
from megamoe.convert.families.minimax_m2 import attention_section_to_hf, sigmoid_moe, sigmoid_moe_to_hf
from megamoe.convert.families.qwen3 import attention_from_hf, common_to_hf
from megamoe.convert.family import Family, hf_get, register
from megamoe.convert.table import Cat, Fn, Rule, Same, alternatives
from megamoe.core.errors import CheckpointError, ConfigError

MIXERS = {"full_attention": "A", "minimax_m3_sparse": "B"}
INDEX_FIELDS = {"num_heads": "index_n_heads", "head_dim": "index_head_dim", "block_size": "index_block_size",
                "topk_blocks": "index_topk_blocks", "local_blocks": "index_local_blocks"}


# ---- configs ---------------------------------------------------------------------------------

def letters(text: dict) -> str:
    n = hf_get(text, "num_hidden_layers")
    mixers = text.get("layer_types") or ["full_attention"] * n
    mlps = text.get("mlp_layer_types") or ["sparse"] * n
    for key, value, allowed in (("layer_types", mixers, MIXERS), ("mlp_layer_types", mlps, MLP_LETTERS)):
        if len(value) != n or any(v not in allowed for v in value):
            raise CheckpointError(f"config.json: text_config.{key}={value} must give one of {list(allowed)} for each "
                                  f"of num_hidden_layers={n} layers")
    return "".join(MIXERS[a] + MLP_LETTERS[m] for a, m in zip(mixers, mlps))


def config_from_hf(hf: dict) -> ModelConfig:
    from megamoe.vision.hf_minimax import minimax_vision_config

    text = dict(text_config(hf))
    layout = letters(text)
    attention = attention_from_hf(text, qk_norm=True)
    attention.partial_rotary_factor = partial_rotary(text)
    if "B" in layout:
        attention.block_index = BlockIndexConfig(**{ours: hf_get(text, theirs) for ours, theirs in INDEX_FIELDS.items()})
    glu = dict(swiglu_limit=text.get("swiglu_limit"), swiglu_alpha=float(hf_get(text, "swiglu_alpha")))
    moe = sigmoid_moe(text, hf_get(text, "intermediate_size"), num_shared_experts=1,
                      shared_expert_ffn_hidden_size=hf_get(text, "shared_intermediate_size"),
                      routed_scaling_factor=float(text.get("routed_scaling_factor") or 1.0), **glu)
    try:
        vision = minimax_vision_config(hf)
    except ConfigError as e:
        raise CheckpointError(f"config.json: {e}") from None
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return ModelConfig(vocab_size=hf_get(text, "vocab_size"), hidden_size=hf_get(text, "hidden_size"), layout=layout,
                       attention=attention, mlp=MLPConfig(ffn_hidden_size=hf_get(text, "dense_intermediate_size"), **glu),
                       moe=moe if "e" in layout else None, norm_eps=text.get("rms_norm_eps", 1e-6),
                       norm_zero_centered=True, tie_embeddings=bool(tie), vision=vision,
                       max_seq_len=text.get("max_position_embeddings", 4096), params_dtype=dtype_name(hf))


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    from megamoe.vision.hf_minimax import ENCODER, minimax_vision_to_hf

    v, kinds = cfg.vision, cfg.parsed_layout().layers
    if v is None or v.encoder != ENCODER or v.projector != "mlp_merger":
        raise CheckpointError(f"export to minimax_m3_vl: model.vision must be the {ENCODER} encoder with "
                              f"projector=mlp_merger (got {None if v is None else (v.encoder, v.projector)})")
    expressible(all(k.mixer in "AB" and k.mlp in "de" for k in kinds), "minimax_m3_vl", "layout", cfg.layout,
                "mixers A or B, MLPs d or e")
    expressible(cfg.norm_zero_centered, "minimax_m3_vl", "norm_zero_centered", False, "Gemma norms (1 + w)")
    out = base_hf_config(cfg, original, "minimax_m3_vl", "MiniMaxM3SparseForConditionalGeneration")
    text = copy.deepcopy(out.get("text_config") or {})
    common_to_hf(cfg, text)
    attention_section_to_hf(cfg, text, "minimax_m3_vl", "head")
    text.pop("rotary_dim", None)  # transformers reads the rotation from rope_parameters only
    if cfg.attention.block_index is not None:
        text.update({theirs: getattr(cfg.attention.block_index, ours) for ours, theirs in INDEX_FIELDS.items()})
    glu = (cfg.mlp.swiglu_limit, cfg.mlp.swiglu_alpha)
    expressible(glu[1] is not None, "minimax_m3_vl", "mlp.swiglu_alpha", glu[1], "SwiGLU-OAI everywhere")
    text.update(model_type="minimax_m3_vl_text", layer_types=[{"A": "full_attention", "B": "minimax_m3_sparse"}[k.mixer]
                                                             for k in kinds],
                mlp_layer_types=["dense" if k.mlp == "d" else "sparse" for k in kinds],
                dense_intermediate_size=cfg.mlp.ffn_hidden_size, swiglu_limit=glu[0], swiglu_alpha=glu[1],
                hidden_act="silu", vocab_size=cfg.vocab_size)
    if cfg.moe is not None:
        m = cfg.moe
        expressible((m.swiglu_limit, m.swiglu_alpha) == glu, "minimax_m3_vl", "moe.swiglu_alpha", m.swiglu_alpha,
                    "one SwiGLU-OAI for dense and expert MLPs")
        sigmoid_moe_to_hf(cfg, text, "minimax_m3_vl", scaling=True, shared=1)
        text.update(intermediate_size=m.moe_ffn_hidden_size, shared_intermediate_size=m.shared_ffn(),
                    routed_scaling_factor=m.routed_scaling_factor)
    out.update(text_config=text, vision_config=minimax_vision_to_hf(v, out.get("vision_config")),
               image_token_index=v.image_token_id, projector_hidden_size=v.projector_hidden or cfg.hidden_size,
               tie_word_embeddings=cfg.tie_embeddings)
    return out


# ---- mapping tables --------------------------------------------------------------------------

# per layout: (text model prefix, lm head, MoE module, selection bias, indexer names, fused gate|up)
TEXT = (("language_model.model.", "language_model.lm_head.weight", "block_sparse_moe",
         "block_sparse_moe.e_score_correction_bias", "self_attn.index_{}", False),
        ("model.language_model.", "lm_head.weight", "mlp", "mlp.gate.e_score_correction_bias",
         "self_attn.indexer.{}", True))
INDEXER = {"linear_q": "q_proj", "linear_k": "k_proj", "q_norm": "q_norm", "k_norm": "k_norm"}


def _gate_up(ours: str, prefix: str, fused: bool, letters: str) -> Rule:
    """A SwiGLU's gate|up: HF gate_proj + up_proj (hub) or one gate_up_proj (in memory)."""
    if fused:
        return Same(ours, f"{prefix}.gate_up_proj.weight", when=letters)
    return Cat(ours, (f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"), when=letters)


def text_rules(cfg: ModelConfig, layout: tuple, experts: list[Rule]) -> list[Rule]:
    model, head, moe, bias, indexer, fused = layout
    layer, mlp = f"{model}layers.{{L}}", "layers.{L}.mlp"
    rules = [Same("embedding.weight", f"{model}embed_tokens.weight"), Same("final_norm.weight", f"{model}norm.weight")]
    if not cfg.tie_embeddings:
        rules.append(Same("output_layer.weight", head))
    rules += [Same("layers.{L}.input_norm.weight", f"{layer}.input_layernorm.weight", when="AB"),
              Same("layers.{L}.pre_mlp_norm.weight", f"{layer}.post_attention_layernorm.weight", when="de"),
              *attention_rules(f"{layer}.self_attn", "AB")]
    rules += [Same(f"layers.{{L}}.mixer.indexer.{ours}.weight", f"{layer}.{indexer.format(theirs)}.weight", when="B")
              for ours, theirs in INDEXER.items()]
    rules += [_gate_up(f"{mlp}.linear_fc1.weight", f"{layer}.mlp", fused, "d"),
              Same(f"{mlp}.linear_fc2.weight", f"{layer}.mlp.down_proj.weight", when="d"),
              Same(f"{mlp}.router.weight", f"{layer}.{moe}.gate.weight", when="e"),
              Same(f"{mlp}.router.expert_bias", f"{layer}.{bias}", when="e"), *experts,
              _gate_up(f"{mlp}.shared_experts.linear_fc1.weight", f"{layer}.{moe}.shared_experts", fused, "e"),
              Same(f"{mlp}.shared_experts.linear_fc2.weight", f"{layer}.{moe}.shared_experts.down_proj.weight",
                   when="e")]
    return rules


# per layout: (vision model prefix, block prefix, patch embedding, projector prefixes for the patch and merge MLPs)
VISION = (("vision_tower.vision_model.", "encoder.layers.", "embeddings.patch_embedding",
           ("multi_modal_projector.linear_{}", "patch_merge_mlp.linear_{}")),
          ("model.vision_tower.", "layers.", "embeddings.proj",
           ("model.multi_modal_projector.linear_{}", "model.multi_modal_projector.merge_linear_{}")))


def _permuted_qkv(to_timm: bool):
    """HF q, k, v (weight or bias) <-> the encoder's fused qkv with q and k rows permuted per head
    for timm's rotate-half pairs (megamoe.vision.minimax_vit.rope_permutation)."""
    def rows(w, ctx):
        from megamoe.vision.minimax_vit import rope_permutation

        heads = int(ctx.cfg.vision.encoder_args.get("num_heads", 16))
        perm = rope_permutation(w.size(0) // heads)
        order = perm if to_timm else torch.argsort(perm)
        return w.reshape(heads, -1, *w.shape[1:])[:, order].reshape(w.shape)

    def convert(t, ctx):
        if to_timm:
            q, k, v = t
            return torch.cat([rows(q, ctx), rows(k, ctx), v], dim=0)
        q, k, v = t.chunk(3, dim=0)
        return [rows(q, ctx), rows(k, ctx), v]
    return convert


def vision_rules(cfg: ModelConfig, layout: tuple) -> list[Rule]:
    root, blocks, patch, projector = layout
    enc, depth = "vision.encoder.model.", int(cfg.vision.encoder_args.get("depth", 32))
    rules: list[Rule] = [Same(f"{enc}patch_weight", f"{root}{patch}.weight")]
    rules += [Same(f"{enc}norm_pre.{p}", f"{root}pre_layrnorm.{p}") for p in ("weight", "bias")]
    parts = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj", "mlp.fc1": "mlp.fc1",
             "mlp.fc2": "mlp.fc2"}
    for b in range(depth):
        ours, theirs = f"{enc}blocks.{b}.", f"{root}{blocks}{b}."
        rules += [Same(f"{ours}{o}.{p}", f"{theirs}{t}.{p}") for o, t in parts.items() for p in ("weight", "bias")]
        rules += [Fn(f"{ours}attn.qkv.{p}", tuple(f"{theirs}self_attn.{x}_proj.{p}" for x in "qkv"),
                     forward=_permuted_qkv(True), backward=_permuted_qkv(False)) for p in ("weight", "bias")]
    names = {"patch.fc1": projector[0].format(1), "patch.fc2": projector[0].format(2),
             "merge_fc1": projector[1].format(1), "merge_fc2": projector[1].format(2)}
    return rules + [Same(f"vision.projector.{o}.{p}", f"{t}.{p}") for o, t in names.items() for p in ("weight", "bias")]


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    experts = expert_rules(f"{TEXT[0][0]}layers.{{L}}.block_sparse_moe", f"{TEXT[1][0]}layers.{{L}}.mlp",
                           ("w1", "w3", "w2"))
    return [*alternatives(*(text_rules(cfg, layout, experts) for layout in TEXT)),
            *alternatives(*(vision_rules(cfg, layout) for layout in VISION))]


def skipped(hf: dict, names: set[str]) -> tuple[set[str], str]:
    mtp = {n for n in names if n.startswith("mtp.") or ".mtp." in n}
    return mtp, ("multi-token-prediction tensors (mtp.*) are not converted (transformers ignores them too)"
                 if mtp else "")


MINIMAX_M3_VL = register(Family("minimax_m3_vl", "MiniMaxM3SparseForConditionalGeneration", config_from_hf,
                                config_to_hf, rules, skipped=skipped,
                                notes="GQA (A) and block-sparse attention (B), SwiGLU-OAI dense and MoE MLPs "
                                      "(sigmoid routing, scaled, one shared expert), Gemma norms; the vision tower "
                                      "(megamoe's timm-style minimax_m3_vit_enc) and its MLP merger; images, not video"))
