"""GLM-5 (glm_moe_dsa: MLA + DSA with shared-indexer layers, dense-then-MoE, group-limited
routing), MiniMax-M2 and MiniMax-M3-VL against transformers on tiny random configs: the round
trip of tests/conversion_harness.py (logits, export, 16 greedy tokens), every gradient
(tests/family_checks.py), TP=2 x EP=2 and CP=2 equal one process, 50 LoRA steps with frozen routing."""
from __future__ import annotations

import pytest
import torch

from tests.family_checks import (assert_gradients_match, assert_lora_trains, assert_parallel_equals_single, batch,
                                 hf_gradient_errors, lora_case, parallel_grads_case)

TOKENS = dict(vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@torch.no_grad()
def randomize(model, seed: int = 1):
    """Weights of order 0.2 (every block matters to the logits), norm weights around 1, a selection
    bias the size of the sigmoid scores' spread, the indexers' head weights positive (a key every
    head scores exactly 0 ties, and torch.topk orders ties unspecified: tests/test_dsa.py)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") or "layernorm" in name else 0.2 * noise)
        if name.endswith("indexer.weights_proj.weight"):
            p.abs_()
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model.eval()


def tiny_glm_moe_dsa():
    """Four layers: full, shared, full, shared indexers (the shared ones attend over the previous
    full layer's selection, which differs from what their own scores would pick); one dense
    layer, then MoE with 4 groups of which 2 are used."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
                          qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, n_routed_experts=8,
                          n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, index_topk=5,
                          index_head_dim=8, index_n_heads=8, first_k_dense_replace=1,
                          indexer_types=["full", "shared", "full", "shared"], rms_norm_eps=1e-5, **TOKENS)
    return randomize(GlmMoeDsaForCausalLM(cfg))


def test_glm_moe_dsa_round_trip(tmp_path):
    from megamoe.convert.api import open_hf
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_glm_moe_dsa(), tmp_path)
    cfg = open_hf(tmp_path / "hf_per_expert")[2]
    assert cfg.parsed_layout().compact() == "DdReDeRe" and cfg.mla.indexer.rope == "interleaved"


def test_glm_moe_dsa_gradients(tmp_path):
    hf = tiny_glm_moe_dsa()
    hf.save_pretrained(tmp_path)
    errs = hf_gradient_errors(hf, tmp_path, *batch(TOKENS["vocab_size"]))
    assert any("indexer" in k for k in errs) and any(k.startswith("layers.1.mixer") for k in errs)
    assert_gradients_match(errs)




def tiny_minimax_m2():
    """QK-norm over all heads, a quarter of each head rotated, 8 sigmoid-routed experts top-2
    with a selection bias."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    cfg = MiniMaxM2Config(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, rotary_dim=4, num_local_experts=8,
                          num_experts_per_tok=2, rms_norm_eps=1e-5, **TOKENS)
    return randomize(MiniMaxM2ForCausalLM(cfg))


def test_minimax_m2_round_trip(tmp_path):
    from megamoe.convert.api import open_hf
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_minimax_m2(), tmp_path)
    cfg = open_hf(tmp_path / "hf_per_expert")[2]
    assert cfg.attention.qk_norm_scope == "all" and cfg.attention.rotary_dim(32) == 4


def test_minimax_m2_gradients(tmp_path):
    hf = tiny_minimax_m2()
    hf.save_pretrained(tmp_path)
    assert_gradients_match(hf_gradient_errors(hf, tmp_path, *batch(TOKENS["vocab_size"])))


# ---- every family: parallel layouts and LoRA ----------------------------------------------------

BUILDERS = {"glm_moe_dsa": tiny_glm_moe_dsa, "minimax_m2": tiny_minimax_m2}
LAYOUTS = [("glm_moe_dsa", dict(tp=2, ep=2), True), ("glm_moe_dsa", dict(cp=2), False),
           ("minimax_m2", dict(tp=2, ep=2), True)]


@pytest.mark.parametrize("family,parallel,sp", LAYOUTS, ids=[f"{f}-{'-'.join(p)}" for f, p, _ in LAYOUTS])
def test_parallel_equals_single(pool, tmp_path, family, parallel, sp):
    """Two gloo ranks (TP=2 x EP=2 with sequence parallelism overlays EP on the TP pair; CP=2
    for each new mixer): loss, logits and every gradient equal one process (rel 1e-5)."""
    BUILDERS[family]().save_pretrained(tmp_path)
    ids = batch(TOKENS["vocab_size"], seq=16)[0]
    ref = parallel_grads_case(str(tmp_path), None, ids)
    for rank, got in enumerate(pool(2).run(parallel_grads_case, str(tmp_path), parallel, ids, sp)):
        assert_parallel_equals_single(got, ref, f"{family} {parallel} rank {rank}")


@pytest.mark.parametrize("family", list(BUILDERS))
def test_lora_finetune(tmp_path, family):
    from megamoe.convert import import_hf

    BUILDERS[family]().save_pretrained(tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "base", progress=False)
    assert_lora_trains(lora_case(str(ckpt), str(tmp_path / "run")))
