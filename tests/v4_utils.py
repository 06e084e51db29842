"""DeepSeek-V4 test helpers: one tiny configuration on both sides (megamoe's ``compressed`` section and
transformers' ``DeepseekV4Config``), random weights, and copying an HF attention's weights.

Sizes: hidden 32, 4 query heads of 16 (8 rotated), one key/value head, window 6, CSA blocks of 4
(indexer: 8 heads of 12, top 3), HCA blocks of 8, 2 output groups of rank 8, YaRN factor 4."""
from __future__ import annotations

import dataclasses

import torch

from megamoe.core.config import (CompressedAttentionConfig, DSAConfig, HyperConnectionConfig, ModelConfig, MoEConfig,
                                 YarnConfig)

HF_TYPES = {"W": "sliding_attention", "C": "compressed_sparse_attention", "H": "heavily_compressed_attention",
            "h": "hash_moe", "e": "moe"}
ATTN_NAMES = {  # ours -> transformers' DeepseekV4Attention
    "linear_q_down.weight": "q_a_proj.weight", "q_norm.weight": "q_a_norm.weight", "linear_q.weight": "q_b_proj.weight",
    "linear_kv.weight": "kv_proj.weight", "kv_norm.weight": "kv_norm.weight", "sinks": "sinks",
    "linear_out_groups.weight": "o_a_proj.weight", "linear_proj.weight": "o_b_proj.weight",
    "compressor.position_bias": "compressor.position_bias", "compressor.norm.weight": "compressor.kv_norm.weight",
    "indexer.compressor.position_bias": "compressor.indexer.position_bias",
    "indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
    "indexer.linear_q.weight": "compressor.indexer.q_b_proj.weight",
    "indexer.linear_weights.weight": "compressor.indexer.scorer.weights_proj.weight",
    "compressor.linear_kv_gate.weight": ("compressor.kv_proj.weight", "compressor.gate_proj.weight"),
    "indexer.compressor.linear_kv_gate.weight": ("compressor.indexer.kv_proj.weight",
                                                 "compressor.indexer.gate_proj.weight"),
}


def compressed(**kw) -> CompressedAttentionConfig:
    base = dict(num_heads=4, head_dim=16, rope_head_dim=8, q_lora_rank=12, o_groups=2, o_lora_rank=8, sliding_window=6,
                csa_rate=4, hca_rate=8, yarn=YarnConfig(factor=4.0, original_max_position=16),
                indexer=DSAConfig(num_heads=8, head_dim=12, topk=3))
    base.update(kw)
    return CompressedAttentionConfig(**base)


def tiny_v4(layout: str = "WhCeHe", **kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, layout=layout, norm_eps=1e-6, compressed=compressed(),
                moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, num_shared_experts=1,
                              score_function="sqrtsoftplus", routed_scaling_factor=1.5, expert_bias=True,
                              swiglu_limit=1.0),
                hyper_connections=HyperConnectionConfig(streams=3, head="learned"))
    base.update(kw)
    return ModelConfig(**base)


def hf_config(layout: str = "WhCeHe", **kw):
    """transformers' config of the same tiny model (eager attention)."""
    from transformers import DeepseekV4Config

    kinds = [layout[i:i + 2] for i in range(0, len(layout), 2)]
    base = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=len(kinds),
                num_attention_heads=4, head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5, num_experts_per_tok=2,
                n_routed_experts=4, layer_types=[HF_TYPES[k[0]] for k in kinds],
                mlp_layer_types=[HF_TYPES[k[1]] for k in kinds],
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=6,
                o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=12, index_topk=3, hc_mult=3,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, swiglu_limit=1.0, max_position_embeddings=64,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    base.update(kw)
    cfg = DeepseekV4Config(**base)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize_v4(module: torch.nn.Module, seed: int = 0, std: float = 0.2) -> torch.nn.Module:
    """Random weights everywhere (norms around 1); sinks, position biases and HC bases N(0, 0.5);
    the indexer's head weights made non-negative (fewer exact-zero score ties, as in test_dsa);
    a hash table of distinct experts per token and a random selection bias."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        if not p.is_floating_point():  # megamoe's hash table keeps its (distinct experts) default
            continue
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif any(k in name for k in ("sinks", "position_bias", "hc.base", "_hc.base", "hc_base")):
            p.copy_(0.5 * noise)
        else:
            p.copy_(std * noise)
        if "weights_proj" in name:
            p.abs_()
    for name, b in module.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(4, generator=gen)[:b.size(1)] for _ in range(b.size(0))]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return module


@torch.no_grad()
def copy_attention(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    """HF DeepseekV4Attention weights into our mixer (every parameter named, none forgotten)."""
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        src = ATTN_NAMES[name]
        p.copy_(torch.cat([theirs[s] for s in src]) if isinstance(src, tuple) else theirs[src])


def hf_attention_inputs(hf_cfg, x: torch.Tensor):
    """(position embeddings, position ids, sliding causal mask) for HF's attention on x [b, s, h]."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    b, s = x.shape[:2]
    pos = torch.arange(s).expand(b, -1)
    rot = DeepseekV4RotaryEmbedding(hf_cfg)
    pe = {k: rot(x, pos, layer_type=k) for k in ("main", "compress")}
    i = torch.arange(s)
    allowed = (i[None] <= i[:, None]) & (i[None] > i[:, None] - hf_cfg.sliding_window)
    return pe, pos, torch.zeros(s, s).masked_fill(~allowed, float("-inf")).expand(b, 1, s, s)


def with_compressed(cfg: ModelConfig, **kw) -> ModelConfig:
    return dataclasses.replace(cfg, compressed=dataclasses.replace(cfg.compressed, **kw))
