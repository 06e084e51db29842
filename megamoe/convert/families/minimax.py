"""MiniMax-01 (``minimax``): lightning attention (``L``) interleaved with softmax GQA (``A``) by
``layer_types``, every layer softmax top-k MoE, and MiniMax's scaled residual
(``model.scaled_residual``: n = norm(x); x = alpha * n + beta * f(n)).

HF names (per-expert layout; the stacked layout moves the router and experts to ``mlp``)::

    self_attn.q_proj|k_proj|v_proj -> mixer.linear_qkv (per KV group)   self_attn.o_proj -> mixer.linear_proj
    self_attn.qkv_proj -> mixer.linear_qkv ('L', per head [q | k | v])  self_attn.output_gate -> mixer.linear_gate
    self_attn.norm -> mixer.norm                                        self_attn.out_proj -> mixer.linear_proj
    self_attn.slope_rate, query_decay, key_decay, diagonal_decay: buffers the config determines
        (megamoe computes the slopes): checked on import, written on export
    block_sparse_moe.gate -> mlp.router; block_sparse_moe.experts.{E}.w1|w3|w2 -> mlp.experts (gate|up, down)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megamoe.core.config import LightningConfig, ModelConfig, ScaledResidualConfig
from megamoe.convert.families.common import (attention_rules, base_hf_config, dtype_name, embedding_rules,
                                             moe_rules, norm_rules, type_letters)
from megamoe.convert.families.deepseek_v3 import check_silu, expressible
from megamoe.convert.families.qwen3 import attention_from_hf, attention_to_hf, common_to_hf
from megamoe.convert.families.qwen3_moe import check_moe_routing, moe_from_hf, moe_to_hf
from megamoe.convert.family import WITH_FP8, Family, hf_get, register
from megamoe.convert.table import Ctx, Rule, Same, fmt
from megamoe.core.errors import CheckpointError
from megamoe.layers.mixers.lightning import lightning_slopes

LETTERS = {"full_attention": "A", "linear_attention": "L"}
HF_LIGHTNING_NORM_EPS = 1e-6  # HF builds the lightning output norm with the default eps


# ---- config buffers --------------------------------------------------------------------------

@dataclass(frozen=True)
class WithBuffers(Rule):
    """``base`` plus HF buffers its config determines (persistent, never trained). Imports check
    them against ``make(ctx)``: megamoe computes them from the config, so a checkpoint whose
    buffers differ cannot be represented and is an error naming the tensor. Exports write them."""

    base: Rule = None
    buffers: tuple[str, ...] = ()
    make: Callable[[Ctx], list[torch.Tensor]] = None

    def hf_names(self, ctx, available):
        return self.base.hf_names(ctx, available) + [fmt(p, ctx) for p in self.buffers]

    def to_mm(self, tensors, ctx):
        k = len(self.buffers)
        for pattern, got, want in zip(self.buffers, tensors[-k:], self.make(ctx)):
            name = fmt(pattern, ctx)
            if tuple(got.shape) != tuple(want.shape):
                raise ValueError(f"{name} has shape {list(got.shape)}, the config implies {list(want.shape)}")
            tol = 1e-5 if got.element_size() >= 4 else 1e-2
            if not got.is_meta and not torch.allclose(got.float(), want, rtol=tol, atol=1e-7):
                diff = (got.float() - want).abs().max().item()
                raise CheckpointError(f"{name} differs from what the config implies (max abs diff {diff:.2e}); "
                                      f"megamoe derives it from the config")
        return self.base.to_mm(tensors[:-k], ctx)

    def to_hf(self, tensor, ctx):
        return self.base.to_hf(tensor, ctx) + [b.to(tensor.dtype) for b in self.make(ctx)]


def lightning_buffers(ctx: Ctx) -> list[torch.Tensor]:
    """slope_rate [H, 1, 1], query_decay and key_decay [H, B, 1], diagonal_decay [1, H, B, B]
    (B = HF block_size) in fp32, from the slopes the lightning mixer uses, as MiniMaxLightningAttention
    lays them out."""
    block = int(ctx.hf.get("block_size") or ctx.cfg.lightning.block_size)
    slopes = lightning_slopes(ctx.cfg.lightning.num_heads, ctx.layer, ctx.cfg.parsed_layout().num_layers)
    rate = torch.tensor(slopes, dtype=torch.float32)[:, None, None]
    steps = torch.arange(block) + 1
    query = torch.exp(-rate * steps[:, None])
    key = torch.exp(-rate * (block - steps[:, None]))
    dist = rate * (steps[:, None] - steps[None, :])[None, None]
    diagonal = torch.exp(torch.where(dist >= 0, -dist, float("-inf")))
    return [rate, query, key, diagonal]


# ---- config --------------------------------------------------------------------------------

def layer_letters(hf: dict) -> list[str]:
    n = hf_get(hf, "num_hidden_layers")
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)]
    return type_letters(types, "layer_types", LETTERS, n)


def config_from_hf(hf: dict) -> ModelConfig:
    check_silu(hf)
    if hf.get("sliding_window"):
        raise CheckpointError(f"config.json: sliding_window={hf['sliding_window']} is not supported for minimax")
    kind = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    if kind != "default":
        raise CheckpointError(f"config.json: rope_parameters.rope_type={kind!r} is not supported for minimax "
                              f"(allowed: default)")
    letters = layer_letters(hf)
    attention = attention_from_hf(hf, qk_norm=False)
    moe = moe_from_hf({**hf, "norm_topk_prob": True, "moe_intermediate_size": hf_get(hf, "intermediate_size")})
    lightning = LightningConfig(num_heads=attention.num_heads, head_dim=attention.dim(hf_get(hf, "hidden_size")),
                                block_size=hf.get("block_size") or 256, norm_eps=HF_LIGHTNING_NORM_EPS)
    factor = lambda key: float(hf.get(key, 1))  # noqa: E731
    residual = ScaledResidualConfig(
        mixer_alpha={"A": factor("full_attn_alpha_factor"), "L": factor("linear_attn_alpha_factor")},
        mixer_beta={"A": factor("full_attn_beta_factor"), "L": factor("linear_attn_beta_factor")},
        mlp_alpha=factor("mlp_alpha_factor"), mlp_beta=factor("mlp_beta_factor"))
    return ModelConfig(vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"),
                       layout="".join(m + "e" for m in letters), attention=attention, lightning=lightning, moe=moe,
                       scaled_residual=residual, norm_eps=hf.get("rms_norm_eps", 1e-5),
                       tie_embeddings=bool(hf.get("tie_word_embeddings")),
                       max_seq_len=hf.get("max_position_embeddings", 4096), params_dtype=dtype_name(hf))


def _check_expressible(cfg: ModelConfig) -> None:
    kinds = {str(k) for k in cfg.parsed_layout().layers}
    expressible(kinds <= {"Ae", "Le"}, "minimax", "layout", cfg.layout, "every layer 'Ae' or 'Le'")
    a, lc, s = cfg.attention, cfg.lightning, cfg.scaled_residual
    expressible(s is not None, "minimax", "scaled_residual", s, "MiniMax layers take the residual after the norm")
    for field, value, want in (("attention.qk_norm", a.qk_norm, False), ("attention.output_gate", a.output_gate, False),
                               ("attention.qkv_bias", a.qkv_bias, False),
                               ("attention.partial_rotary_factor", a.partial_rotary_factor, 1.0),
                               ("attention.mrope_section", a.mrope_section, None),
                               ("attention.softmax_scale", a.softmax_scale, None),
                               ("moe.norm_topk_prob", cfg.moe.norm_topk_prob, True),
                               ("moe.num_shared_experts", cfg.moe.num_shared_experts, 0),
                               ("moe.swiglu_limit", cfg.moe.swiglu_limit, None)):
        expressible(value == want, "minimax", field, value, f"minimax has {want!r}")
    if lc is not None:
        h = cfg.hidden_size
        expressible((lc.num_heads, lc.dim(h)) == (a.num_heads, a.dim(h)), "minimax", "lightning.num_heads",
                    lc.num_heads, "lightning and softmax layers share num_attention_heads and head_dim")
        expressible(lc.norm_eps == HF_LIGHTNING_NORM_EPS, "minimax", "lightning.norm_eps", lc.norm_eps,
                    "HF's lightning output norm uses 1e-6")
    check_moe_routing(cfg, "minimax")


def config_to_hf(cfg: ModelConfig, original: dict | None) -> dict:
    _check_expressible(cfg)
    out = base_hf_config(cfg, original, "minimax", "MiniMaxForCausalLM")
    common_to_hf(cfg, out)
    attention_to_hf(cfg, out)
    out.pop("attention_bias", None)
    moe_to_hf(cfg.moe, out)
    out.pop("norm_topk_prob", None)
    s = cfg.scaled_residual
    out.update(intermediate_size=cfg.moe.moe_ffn_hidden_size, hidden_act="silu", sliding_window=None,
               layer_types=["full_attention" if k.mixer == "A" else "linear_attention"
                            for k in cfg.parsed_layout().layers],
               full_attn_alpha_factor=s.factors("A")[0], full_attn_beta_factor=s.factors("A")[1],
               linear_attn_alpha_factor=s.factors("L")[0], linear_attn_beta_factor=s.factors("L")[1],
               mlp_alpha_factor=s.mlp_alpha, mlp_beta_factor=s.mlp_beta)
    if cfg.lightning is not None:
        out["block_size"] = cfg.lightning.block_size
    return out


# ---- table ---------------------------------------------------------------------------------

def lightning_rules(prefix: str) -> list[Rule]:
    names = {"linear_gate": "output_gate", "norm": "norm", "linear_proj": "out_proj"}
    buffers = tuple(f"{prefix}.{b}" for b in ("slope_rate", "query_decay", "key_decay", "diagonal_decay"))
    return [WithBuffers("layers.{L}.mixer.linear_qkv.weight", (), "L",
                        base=Same("layers.{L}.mixer.linear_qkv.weight", f"{prefix}.qkv_proj.weight", when="L"),
                        buffers=buffers, make=lightning_buffers),
            *(Same(f"layers.{{L}}.mixer.{ours}.weight", f"{prefix}.{theirs}.weight", when="L")
              for ours, theirs in names.items())]


def rules(cfg: ModelConfig, hf: dict) -> list[Rule]:
    layer = "model.layers.{L}"
    return [*embedding_rules(cfg), *norm_rules(layer, "AL", mlp_letters="e"),
            *attention_rules(f"{layer}.self_attn", "A", q_norm=None), *lightning_rules(f"{layer}.self_attn"),
            *moe_rules(f"{layer}.block_sparse_moe", stacked_prefix=f"{layer}.mlp", expert_names=("w1", "w3", "w2"))]


MINIMAX = register(Family("minimax", "MiniMaxForCausalLM", config_from_hf, config_to_hf, rules,
                          notes="lightning + softmax GQA, softmax top-k MoE, scaled post-norm residual",
                          weight_dtypes=WITH_FP8))
