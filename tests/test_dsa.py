"""DeepSeek sparse attention (D: DeepSeek-V3.2, I: GLM-5 pooled, R: GLM-5's shared indexer): the
sparse path equals the dense-mask reference forward and backward, the selection is the
brute-force top-k, decoding equals the full forward, and D and I match transformers given the
same weights (R and D's interleaved indexer RoPE: tests/test_convert_glm5_minimax_m.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.core.config import DSAConfig, YarnConfig
from megamoe.layers.rotary import apply_rotary, cached_yarn_cos_sin
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import (HF_SHAPE, MLA_NAMES, YARN, build_mixer, causal_additive_mask, check_sparse_equals_dense,
                               decode_steps, full_forward, load_from_hf, randomize, tiny_model)
from tests.numerics import max_abs, rel_err

REL = 1e-5
HF_INDEXER = DSAConfig(num_heads=8, head_dim=8, topk=4, kpool=2)
INDEXER_NAMES = {"indexer.linear_q.weight": "indexer.wq_b.weight", "indexer.linear_k.weight": "indexer.wk.weight",
                 "indexer.k_norm.weight": "indexer.k_norm.weight", "indexer.k_norm.bias": "indexer.k_norm.bias",
                 "indexer.linear_weights.weight": "indexer.weights_proj.weight",
                 "indexer.pool_ape": "indexer.index_kpool_compress_ape",
                 "indexer.linear_pool_gate.weight": "indexer.index_kpool_compress_gate"}


def model(letter: str, **mla):
    cfg = tiny_model(f"{letter}d", norm_zero_centered=False, norm_eps=1e-6)
    cfg.mla = dataclasses.replace(cfg.mla, **mla)
    return cfg


def x_of(seed: int, t: int = 12) -> torch.Tensor:
    return torch.randn(2, t, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("letter", ["D", "I"])
@pytest.mark.parametrize("t", [1, 12, 63, 64, 65])
def test_sparse_equals_dense_mask_reference(letter, t):
    """Forward, input gradient and every parameter gradient (fp32), at lengths below, at and
    above the top-k, the key pool and 64."""
    check_sparse_equals_dense(letter, model(letter), x_of(0, t), REL)


def indexer_inputs(mixer, x):
    """What the layer hands its indexer: x, the query latent and (D) the RoPE tables."""
    info = ForwardInfo(positions=torch.arange(x.size(1))[None].expand(x.size(0), -1))
    q_latent = mixer.project(x, info)[2]
    cos_sin = cached_yarn_cos_sin(info, mixer.dr, mixer.theta, mixer.yarn) if mixer.indexer.rope_dim else None
    return q_latent, cos_sin


def test_selection_is_brute_force_topk():
    """Each query keeps the topk causal keys of sum_h w_h relu(q_h.k / sqrt(d)), ties to the earlier key."""
    mixer = build_mixer("D", model("D"))
    ix, x = mixer.indexer, x_of(2, t=9)
    q_latent, (cos, sin) = indexer_inputs(mixer, x)
    idx = ix(x, q_latent, (cos, sin), None)
    with torch.no_grad():
        q = apply_rotary(ix.linear_q(q_latent).view(2, 9, ix.heads, ix.dim), cos, sin)
        k = apply_rotary(ix.k_norm(ix.linear_k(x)).unsqueeze(2), cos, sin).squeeze(2)
        w = ix.linear_weights(x) / ix.heads ** 0.5
    for b in range(2):
        for s in range(9):
            score = [sum(float(w[b, s, h]) * max(float(q[b, s, h] @ k[b, t]) / ix.dim ** 0.5, 0.0)
                         for h in range(ix.heads)) for t in range(s + 1)]
            want = sorted(range(s + 1), key=lambda t: (-score[t], t))[:ix.topk]
            assert sorted(int(i) for i in idx[b, s] if i >= 0) == sorted(want), (b, s)


def test_pooled_selection_structure():
    """I (kpool=2, topk=4): per query, min(2, complete visible pools) whole pools + the tail pool."""
    mixer = build_mixer("I", model("I"))
    x = x_of(3, t=9)
    idx = mixer.indexer(x, indexer_inputs(mixer, x)[0], None, None)
    for s in range(9):
        chosen = sorted(int(i) for i in idx[0, s] if i >= 0)
        tail = [s] if (s + 1) % 2 else []  # the incomplete last pool, always kept
        pooled = [t for t in chosen if t not in tail]
        assert len(pooled) == 2 * min((s + 1) // 2, 2) and set(tail) <= set(chosen), (s, chosen)
        assert all(t <= s and (t ^ 1) in pooled for t in pooled), (s, chosen)  # whole, visible pools


def test_topk_over_all_keys_is_dense_mla():
    """With topk >= T the sparse layer is plain MLA (same weights)."""
    cfg = model("D", indexer=dataclasses.replace(tiny_model().mla.indexer, topk=16))
    sparse = build_mixer("D", cfg)
    dense = build_mixer("M", model("M"))
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    x = x_of(4)
    assert rel_err(full_forward(sparse, x), full_forward(dense, x)) <= REL


@pytest.mark.parametrize("letter", ["D", "I"])
@pytest.mark.parametrize("prefill", [0, 5])
def test_decoding_equals_full_forward(letter, prefill):
    mixer = build_mixer(letter, model(letter))
    x = x_of(5, t=11)
    with torch.no_grad():
        assert rel_err(decode_steps(mixer, x, prefill), full_forward(mixer, x)) <= REL


def hf_indexer_without_ties(hf):
    """Random weights; the indexer's head weights made positive. A key whose every head has
    q.k <= 0 scores exactly 0, and torch.topk breaks such ties in an unspecified order (megamoe
    picks the earlier key): with positive head weights and 8 heads the selection never
    reaches the zero scores, so the comparison is of the maths, not of tie-breaking."""
    randomize(hf)
    with torch.no_grad():
        hf.indexer.weights_proj.weight.abs_()
    return hf


def test_matches_deepseek_v32_indexer_attention():
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    hf_cfg = DeepseekV32Config(q_lora_rank=12, index_topk=4, index_head_dim=8, index_n_heads=8,
                               rope_parameters=YARN, **HF_SHAPE)
    hf_cfg._attn_implementation = "eager"
    hf = hf_indexer_without_ties(m.DeepseekV32Attention(hf_cfg, 0))
    ours = build_mixer("D", model("D", indexer=HF_INDEXER))
    load_from_hf(ours, hf, {**MLA_NAMES, **INDEXER_NAMES})
    x = x_of(6, t=14)
    pos = torch.arange(14)[None].expand(2, -1)
    with torch.no_grad():
        want = hf(x, position_embeddings=m.DeepseekV32RotaryEmbedding(hf_cfg)(x, pos),
                  attention_mask=causal_additive_mask(2, 14), position_ids=pos)[0]
        assert max_abs(full_forward(ours, x), want) <= 1e-5


def test_matches_glm5_next_indexed_attention():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    shape = dict(HF_SHAPE, qk_rope_head_dim=0)
    hf_cfg = Glm5NextTextConfig(q_lora_rank=12, index_topk=4, index_kpool=2, index_head_dim=8, index_n_heads=8,
                                layer_types=["indexed_attention"], indexer_types=["full"], **shape)
    hf_cfg._attn_implementation = "eager"
    hf = hf_indexer_without_ties(Glm5NextTextAttention(hf_cfg, 0))
    ours = build_mixer("I", model("I", qk_rope_head_dim=0, rope="none", yarn=YarnConfig(), indexer=HF_INDEXER))
    load_from_hf(ours, hf, {**MLA_NAMES, **INDEXER_NAMES})
    x = x_of(7, t=14)
    with torch.no_grad():
        want = hf(x, attention_mask=torch.ones(2, 14, dtype=torch.bool))[0]
        assert max_abs(full_forward(ours, x), want) <= 1e-5


def shared_pair(rope: str = "interleaved"):
    """A D layer (layer 1, indexer RoPE ``rope``) and the R layer 2 that reuses its selection."""
    cfg = model("D", indexer=dataclasses.replace(HF_INDEXER, kpool=1, rope=rope))
    return build_mixer("D", cfg, layer_number=1), build_mixer("R", cfg, layer_number=2, seed=7)


def test_shared_selection_layer_attends_over_the_full_layers_selection():
    """R (no indexer of its own) equals an MLA restricted to D's selection, computed sparse and
    dense-mask, forward and every gradient; it reuses the nearest earlier D layer's selection
    and, with none before it, says so in one line."""
    from megamoe.core.errors import ConfigError
    from megamoe.layers.mixers.dsa import SELECTION

    full, shared = shared_pair()
    assert not any(n.startswith("indexer.") for n, _ in shared.named_parameters())
    dense = build_mixer("R", model("D"), layer_number=2, seed=7)
    dense.dense_reference = True
    x = x_of(8, t=13)
    info = ForwardInfo(positions=torch.arange(13)[None].expand(2, -1))
    with torch.no_grad():
        full(x, info)
    idx = info.memo[(SELECTION, 1)]
    info.memo[(SELECTION, 0)] = torch.zeros_like(idx)  # an earlier layer's: not the nearest
    outs = []
    for layer in (shared, dense):
        xi = x.clone().requires_grad_(True)
        y = layer(xi, info)
        (y * y).sum().backward()
        outs.append((y, xi.grad))
    assert rel_err(outs[0][0], outs[1][0]) <= REL and rel_err(outs[0][1], outs[1][1]) <= REL
    for (name, a), b in zip(shared.named_parameters(), dense.parameters()):
        assert rel_err(a.grad, b.grad) <= REL, name
    with pytest.raises(ConfigError, match=r"layer 2 \('R'\) reuses the selection") as err:
        shared(x, ForwardInfo(positions=info.positions))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_shared_selection_decoding_equals_full_forward(rope):
    """D then R, decoded token by token after a prefill, equal the full forward of the pair."""
    from megamoe.layers.cache.decode import InferenceCache

    full, shared = shared_pair(rope)
    x = x_of(9, t=10)
    with torch.no_grad():
        pos = torch.arange(10)[None].expand(2, -1)
        info = ForwardInfo(positions=pos)
        want = shared(full(x, info), info)
        cache, got = InferenceCache(2), []
        for a, b in ((0, 4), *((t, t + 1) for t in range(4, 10))):
            step = ForwardInfo(positions=pos[:, a:b], cache=cache)
            got.append(shared(full(x[:, a:b], step), step))
            cache.advance(b - a)
    assert rel_err(torch.cat(got, dim=1), want) <= REL
