"""What the benchmarks in tools/ share: the peer model's configuration and the machine's speed.

``QWEN3_NEXT_PEER`` is the ``transformers`` Qwen3-Next the training-step and decoding
benchmarks compare against (docs/performance.md, "Peer configurations"); ``matmul_rate`` is
the fp32 GEMM rate every CPU benchmark prints beside its ratios (machines differ about 2x).
"""
from __future__ import annotations

import time

import torch

QWEN3_NEXT_PEER = dict(
    vocab_size=1000, hidden_size=256, num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
    intermediate_size=512, norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1,
    mlp_only_layers=[])


def matmul_rate(n: int = 1024, seconds: float = 0.5) -> float:
    """fp32 GFLOP/s of an ``n^3`` matmul on this machine now, on torch's current threads."""
    a = torch.randn(n, n)
    a @ a
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ a
        count += 1
    return 2 * n ** 3 * count / (time.perf_counter() - start) / 1e9
