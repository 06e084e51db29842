"""Kimi-K2.5 (``kimi_k25``, ``Kimi_K25ForConditionalGeneration``): a deepseek_v3 text model (MLA,
384 routed experts top-8 + a shared one, group-limited sigmoid routing with the expert bias)
under MoonViT, megamoe's timm-style ``kimi_k25_vit_enc`` (megamoe.vision.kimi_vit) with a
``PatchMerger`` projector (LayerNorm eps 1e-5).

Three HF name layouts load; exports write the first (the released checkpoints' names, which
transformers loads):

    hub (exported)                               transformers' in-memory names      megamoe
    language_model.model.layers.{L}.*            model.language_model.layers.{L}.*  layers.{L}.* (deepseek_v3)
    language_model.model.embed_tokens, norm      model.language_model.*             embedding, final_norm
    language_model.lm_head                       lm_head                            output_layer
    vision_tower.patch_embed.proj                model.vision_tower.patch_embed.proj
                                                              vision.encoder.model.patch_embed.proj
    vision_tower.patch_embed.pos_emb.weight      ...pos_emb.position_embeddings     vision.encoder.model.pos_embed
    vision_tower.encoder.blocks.{B}.norm0|norm1  model.vision_tower.layers.{B}.norm1|norm2
                                                              vision.encoder.model.blocks.{B}.norm1|norm2
        .wqkv (q, k rows in interleaved pairs)       .attn.q_proj|k_proj|v_proj (rotate-half rows)
                                                              .attn.qkv (rotate-half rows)
        .wo, .mlp.fc0, .mlp.fc1                      .attn.proj, .mlp.fc1, .mlp.fc2  .attn.proj, .mlp.fc1, .mlp.fc2
    vision_tower.encoder.final_layernorm         model.vision_tower.final_layernorm vision.encoder.model.norm
    mm_projector.pre_norm, proj.0, proj.2        model.mm_projector.pre_norm, in_proj, out_proj
                                                              vision.projector.norm, fc1, fc2

transformers' default ``save_pretrained`` writes the hub names with three differences, also
read: ``language_model.model.blocks.{L}``, ``vision_tower.encoder.patch_embed.proj`` and
``model.mm_projector.pre_norm``. Multi-token-prediction layers are skipped as for deepseek_v3.
"""
from __future__ import annotations

import copy

import torch

from megamoe.core.config import ModelConfig
from megamoe.convert.families import deepseek_v3
from megamoe.convert.families.common import base_hf_config, text_config
from megamoe.convert.family import WITH_FP8, Family, register
from megamoe.convert.table import Cat, Fn, Rule, Same, alternatives
from megamoe.core.errors import CheckpointError, ConfigError

ENCODER = "kimi_k25_vit_enc"

# per layout: hub (exports), transformers' default save, transformers' in-memory names
LM = (("language_model.model.", "layers", "language_model.lm_head.weight"),
      ("language_model.model.", "blocks", "language_model.lm_head.weight"),
      ("model.language_model.", "layers", "lm_head.weight"))
HUB_BLOCK = {"norm1": "norm0", "norm2": "norm1", "attn.proj": "wo", "mlp.fc1": "mlp.fc0", "mlp.fc2": "mlp.fc1"}
MEMORY_BLOCK = {"norm1": "norm1", "norm2": "norm2", "attn.proj": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
VISION = (  # (patch embedding, position table, block prefix, block parts, final norm, projector names)
    ("vision_tower.patch_embed.proj", "vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.blocks.",
     HUB_BLOCK, "vision_tower.encoder.final_layernorm",
     {"norm": "mm_projector.pre_norm", "fc1": "mm_projector.proj.0", "fc2": "mm_projector.proj.2"}),
    ("vision_tower.encoder.patch_embed.proj", "vision_tower.patch_embed.pos_emb.weight",
     "vision_tower.encoder.blocks.", HUB_BLOCK, "vision_tower.encoder.final_layernorm",
     {"norm": "model.mm_projector.pre_norm", "fc1": "mm_projector.proj.0", "fc2": "mm_projector.proj.2"}),
    ("model.vision_tower.patch_embed.proj", "model.vision_tower.patch_embed.pos_emb.position_embeddings",
     "model.vision_tower.layers.", MEMORY_BLOCK, "model.vision_tower.final_layernorm",
     {"norm": "model.mm_projector.pre_norm", "fc1": "model.mm_projector.in_proj", "fc2": "model.mm_projector.out_proj"}),
)


# ---- configs ---------------------------------------------------------------------------------

def config_from_hf(hf: dict) -> ModelConfig:
    from megamoe.vision.hf_kimi import kimi_vision_config

    text = dict(text_config(hf))
    for key in ("tie_word_embeddings", "dtype"):  # the top-level values are the ones transformers uses
        if hf.get(key) is not None:
            text[key] = hf[key]
    cfg = deepseek_v3.config_from_hf(text)
    try:
        cfg.vision = kimi_vision_config(hf)
    except ConfigError as e:
        raise CheckpointError(f"config.json: {e}") from None
    return cfg


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    from megamoe.vision.hf_kimi import kimi_vision_to_hf

    v = cfg.vision
    if v is None or v.encoder != ENCODER or v.projector != "merger":
        raise CheckpointError(f"export to kimi_k25: model.vision must be the {ENCODER} encoder with projector=merger "
                              f"(got {None if v is None else (v.encoder, v.projector)})")
    out = base_hf_config(cfg, original, "kimi_k25", "Kimi_K25ForConditionalGeneration")
    text = deepseek_v3.config_to_hf(cfg, copy.deepcopy(out.get("text_config")) or None)
    text.pop("architectures", None)
    text["model_type"] = "deepseek_v3"  # the hub's 'kimi_k2' is the same model
    vision = kimi_vision_to_hf(v, out.get("vision_config"))
    out.update(text_config=text, vision_config=vision, image_token_id=v.image_token_id,
               projection_hidden_size=vision["hidden_size"], projection_layer_norm_eps=v.projector_norm_eps,
               tie_word_embeddings=cfg.tie_embeddings)
    return out


# ---- mapping tables --------------------------------------------------------------------------

def _rope_rows(w: torch.Tensor, heads: int, to_half: bool) -> torch.Tensor:
    """Per head, q/k rows in interleaved pairs (MoonViT's complex rotation) <-> rotate-half order."""
    rows = w.size(0)
    shape = (heads, rows // heads // 2, 2) if to_half else (heads, 2, rows // heads // 2)
    return w.reshape(*shape, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _wqkv(to_half: bool):
    def convert(t, ctx):
        w = t[0] if isinstance(t, (list, tuple)) else t
        heads = int(ctx.cfg.vision.encoder_args.get("num_heads", 16))
        q, k, v = w.chunk(3, dim=0)
        return torch.cat([_rope_rows(q, heads, to_half), _rope_rows(k, heads, to_half), v], dim=0)
    return convert


def vision_rules(cfg: ModelConfig, layout: tuple) -> list[Rule]:
    patch, pos, block, parts, final, projector = layout
    enc, depth = "vision.encoder.model.", int(cfg.vision.encoder_args.get("depth", 27))
    memory = parts is MEMORY_BLOCK
    rules: list[Rule] = [Same(f"{enc}pos_embed", pos)]
    rules += [Same(f"{enc}patch_embed.proj.{p}", f"{patch}.{p}") for p in ("weight", "bias")]
    rules += [Same(f"{enc}norm.{p}", f"{final}.{p}") for p in ("weight", "bias")]
    for b in range(depth):
        ours, theirs = f"{enc}blocks.{b}.", f"{block}{b}."
        rules += [Same(f"{ours}{o}.{p}", f"{theirs}{t}.{p}") for o, t in parts.items() for p in ("weight", "bias")]
        for p in ("weight", "bias"):
            if memory:
                rules.append(Cat(f"{ours}attn.qkv.{p}", tuple(f"{theirs}attn.{x}_proj.{p}" for x in "qkv")))
            else:
                rules.append(Fn(f"{ours}attn.qkv.{p}", (f"{theirs}wqkv.{p}",), forward=_wqkv(True),
                                backward=_wqkv(False)))
    rules += [Same(f"vision.projector.{o}.{p}", f"{t}.{p}") for o, t in projector.items() for p in ("weight", "bias")]
    return rules


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    text = [deepseek_v3.text_rules(cfg, model=m, layers=layers, head=head) for m, layers, head in LM]
    return [*alternatives(*text), *alternatives(*(vision_rules(cfg, layout) for layout in VISION))]


def skipped(hf: dict, names: set[str]) -> tuple[set[str], str]:
    """Multi-token-prediction layers after the last text layer, in any of the three layouts."""
    found, why = set(), ""
    for model, layers, _ in LM:
        mtp, reason = deepseek_v3.mtp_skipped(text_config(hf), names, prefix=f"{model}{layers}.")
        found, why = found | mtp, why or reason
    return found, why


KIMI_K25 = register(Family("kimi_k25", "Kimi_K25ForConditionalGeneration", config_from_hf, config_to_hf, rules,
                           notes="deepseek_v3 text (MLA + 384-expert group-limited MoE) under MoonViT "
                           f"(megamoe's timm-style {ENCODER}) and its 2x2 patch merger; images, not video",
                           skipped=skipped, weight_dtypes=WITH_FP8))
