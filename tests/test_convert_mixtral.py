"""Conversion of mixtral (GQA without QK-norm, softmax top-2 renormalised, every layer MoE) with a
sliding window shorter than the prompt: the round trip of tests/conversion_harness.py. The
per-expert layout keeps router and experts under ``block_sparse_moe`` (w1/w3/w2), the stacked
layout under ``mlp``: both load."""
from __future__ import annotations

from tests.mixer_utils import randomize


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                         sliding_window=6)


def tiny_mixtral():
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM(mixtral_config())
    randomize(model, 0, std=0.1)
    return model.eval()


def test_mixtral_round_trip(tmp_path):
    from megamoe.convert.families.mixtral import config_from_hf
    from tests.conversion_harness import check_round_trip

    model = tiny_mixtral()
    cfg = config_from_hf(model.config.to_dict())
    assert cfg.layout == "SeSe" and cfg.attention.sliding_window == 6 and cfg.moe.norm_topk_prob
    check_round_trip(model, tmp_path)
