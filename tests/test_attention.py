"""Softmax attention A and sliding-window S: decoding equals the full forward (S keeps only its
window in the cache), S equals a naive banded softmax, A matches transformers' Qwen3-Next
gated attention (output gate, partial rotary, zero-centred QK-norm)."""
from __future__ import annotations

import pytest
import torch

from megamoe.layers.cache.decode import InferenceCache
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import (build_mixer, causal_additive_mask, decode_steps, full_forward, load_from_hf,
                               randomize, tiny_model)
from tests.numerics import max_abs, rel_err

REL = 1e-5


def x_of(seed: int, t: int = 11) -> torch.Tensor:
    return torch.randn(2, t, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("letter", ["A", "S"])
@pytest.mark.parametrize("prefill", [0, 5])
def test_decoding_equals_full_forward(letter, prefill):
    mixer = build_mixer(letter, tiny_model())
    x = x_of(0)
    with torch.no_grad():
        assert rel_err(decode_steps(mixer, x, prefill), full_forward(mixer, x)) <= REL


def test_sliding_window_cache_holds_only_the_window():
    mixer = build_mixer("S", tiny_model())  # sliding_window=3
    cache = InferenceCache(2)
    with torch.no_grad():
        mixer(x_of(1, t=7), ForwardInfo(positions=cache.positions(7), cache=cache))
    assert cache.layer(mixer.layer_number)["k"].size(1) == 2  # window - 1 past keys


def test_sliding_window_equals_naive_banded_softmax():
    mixer = build_mixer("S", tiny_model())
    x = x_of(2)
    info = ForwardInfo(positions=torch.arange(11)[None].expand(2, -1))
    with torch.no_grad():
        q, k, v, gate = mixer.project(x, info)
        k, v = (t.repeat_interleave(mixer.n_rep, dim=2) for t in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * mixer.head_dim ** -0.5
        i = torch.arange(11)
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)
        p = scores.masked_fill(~band, float("-inf")).softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(2, 11, -1) * torch.sigmoid(gate)
        assert rel_err(full_forward(mixer, x), mixer.linear_proj(out)) <= REL


def fused_qkv_from_hf(hf, heads: int, kv_heads: int, d: int) -> torch.Tensor:
    """HF q_proj (per head [q | gate]), k_proj, v_proj -> megamoe's fused rows, one block per KV
    group: [q|gate of the group's heads, k_g, v_g]."""
    q = hf.q_proj.weight.view(kv_heads, heads // kv_heads * 2 * d, -1)
    k, v = (w.view(kv_heads, d, -1) for w in (hf.k_proj.weight, hf.v_proj.weight))
    return torch.cat([q, k, v], dim=1).reshape(-1, q.size(-1))


def test_matches_qwen3_next_gated_attention():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    hf_cfg = Qwen3NextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             partial_rotary_factor=0.5, rms_norm_eps=1e-6, num_hidden_layers=1,
                             layer_types=["full_attention"], vocab_size=64, pad_token_id=0)
    hf_cfg._attn_implementation = "eager"
    hf = m.Qwen3NextAttention(hf_cfg, 0)
    randomize(hf)
    with torch.no_grad():  # zero-centred norms store w around 0: (1 + w) is applied
        for norm in (hf.q_norm, hf.k_norm):
            norm.weight.sub_(1.0)
    ours = build_mixer("A", tiny_model(norm_eps=1e-6))
    with torch.no_grad():
        ours.linear_qkv.weight.copy_(fused_qkv_from_hf(hf, 4, 2, 8))
    load_from_hf(ours, hf, {"q_norm.weight": "q_norm.weight", "k_norm.weight": "k_norm.weight",
                            "linear_proj.weight": "o_proj.weight", "linear_qkv.weight": None})
    x = x_of(3, t=12)
    pos = torch.arange(12)[None].expand(2, -1)
    with torch.no_grad():
        want = hf(x, position_embeddings=m.Qwen3NextRotaryEmbedding(hf_cfg)(x, pos),
                  attention_mask=causal_additive_mask(2, 12))[0]
        assert max_abs(full_forward(ours, x), want) <= 1e-5
