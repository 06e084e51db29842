"""Conversion of dense families, and the conversion framework's error handling."""
from __future__ import annotations

import torch


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=12, intermediate_size=64))


def test_qwen3_round_trip(tmp_path):
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_qwen3(), tmp_path, layouts=False)
