"""Conversion of kimi_linear (KDA + NoPE MLA + DeepSeek-style MoE) and bailing_hybrid / Ling 2.5
(full-rank safe-gate KDA + gated MLA with YaRN + group-routed MoE): the round trip of
tests/conversion_harness.py on tiny random models. Both families save other names than they
hold in memory (the hub layout), so the two saved layouts differ in more than the experts."""
from __future__ import annotations

import pytest

from tests.mixer_utils import TOKENS, YARN
from tests.test_convert_deepseek import randomized

MLA = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
           num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
           num_experts=8, num_shared_experts=1, num_experts_per_token=2, num_expert_group=4, topk_group=2,
           rms_norm_eps=1e-5, **TOKENS)


def tiny_kimi_linear(seed: int = 0):
    """A KDA layer with a dense MLP, an MLA layer with experts (the hub's 1-indexed linear_attn_config)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    lin = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1], "full_attn_layers": [2]}
    cfg = KimiLinearConfig(num_hidden_layers=2, q_lora_rank=None, linear_attn_config=lin, first_k_dense_replace=1,
                           routed_scaling_factor=2.446, **MLA)
    return randomized(KimiLinearForCausalLM(cfg), seed)


def tiny_bailing_hybrid(seed: int = 0):
    """K then M layers (layer_group_size 2), dense then experts; KDA head_dim 8 != qk_rope_head_dim,
    YaRN on the MLA."""
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    rope = dict(YARN, rope_theta=600.0, original_max_position_embeddings=16)
    cfg = BailingHybridConfig(num_hidden_layers=2, layer_group_size=2, head_dim=8, q_lora_rank=12,
                              first_k_dense_replace=1, rope_parameters=rope, max_position_embeddings=64, **MLA)
    return randomized(BailingHybridForCausalLM(cfg), seed)


@pytest.mark.parametrize("build", [tiny_kimi_linear, tiny_bailing_hybrid], ids=["kimi_linear", "bailing_hybrid"])
def test_round_trip(build, tmp_path):
    from tests.conversion_harness import check_round_trip

    check_round_trip(build(), tmp_path)


def test_hub_config_readers():
    """config.json as the hubs publish it: kimi_linear's 1-indexed linear_attn_config (no
    layer_types), bailing_hybrid's head_dim meaning the KDA head size (no linear_head_dim)."""
    from megamoe.convert.family import get_family

    moe = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
               num_experts_per_token=2, num_shared_experts=1, num_expert_group=1, topk_group=1, kv_lora_rank=8,
               qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, num_attention_heads=4, num_key_value_heads=4)
    kimi = get_family("kimi_linear").config_from_hf(dict(
        moe, num_hidden_layers=4, first_k_dense_replace=1, linear_attn_config={
            "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3, "kda_layers": [1, 2, 3], "full_attn_layers": [4]}))
    assert kimi.parsed_layout().compact() == "KdKeKeMe"
    assert (kimi.kda.num_heads, kimi.kda.head_dim, kimi.kda.conv_kernel, kimi.kda.rank()) == (2, 8, 3, 8)
    assert kimi.mla.rope == "none" and kimi.mla.q_lora_rank is None and kimi.moe.routed_scaling_factor == 2.446
    ling = get_family("bailing_hybrid").config_from_hf(dict(
        moe, num_hidden_layers=4, layer_group_size=2, first_k_dense_replace=2, head_dim=8, short_conv_kernel_size=3,
        kda_lower_bound=-4.0))
    assert ling.parsed_layout().compact() == "KdMdKeMe"
    assert (ling.kda.num_heads, ling.kda.head_dim, ling.kda.conv_kernel, ling.kda.gate_rank,
            ling.kda.gate_lower_bound) == (4, 8, 3, 0, -4.0)
    assert ling.mla.head_gate and ling.mla.rope == "interleaved" and ling.mla.rope_theta == 6e6


def test_one_of_reads_either_layout_and_writes_the_first():
    """OneOf (megamoe.convert.table): the first layout whose tensors are all present is read;
    exports (nothing available) write the first; a partial layout reports the first's tensor."""
    import torch

    from megamoe.core.config import KDAConfig, ModelConfig
    from megamoe.convert.families.kimi_linear import kda_rules
    from megamoe.convert.table import alternatives, check_plan, expand
    from megamoe.core.errors import CheckpointError

    cfg = ModelConfig(vocab_size=8, hidden_size=4, layout="Kd", kda=KDAConfig(num_heads=1, head_dim=2, conv_kernel=3))
    hub, memory = (kda_rules("x", forget=f, split_conv=s, a_log_shape=(1, 1, -1, 1), low_rank=True)
                   for f, s in (("", True), ("forget_gate.", False)))
    table = [r for r in alternatives(hub, memory) if r.mm == "layers.{L}.mixer.conv_weight"]
    conv = torch.arange(18.0).reshape(6, 1, 3)
    (mem,) = expand(table, cfg, {}, {"x.conv1d.weight"})
    assert mem.hf == ["x.conv1d.weight"] and torch.equal(mem.to_mm([conv]), conv.squeeze(1))
    (out,) = expand(table, cfg, {}, set())
    assert out.hf == [f"x.{p}_conv1d.weight" for p in "qkv"]
    assert torch.equal(torch.cat(out.to_hf(conv.squeeze(1))), conv)
    (part,) = expand(table, cfg, {}, {"x.q_conv1d.weight"})
    with pytest.raises(CheckpointError, match="x.k_conv1d.weight .* is missing"):
        check_plan([part], {part.mm: (6, 3)}, {"x.q_conv1d.weight": (2, 1, 3)}, "ckpt")


@pytest.mark.parametrize("build", [tiny_kimi_linear], ids=["kimi_linear"])
def test_parallel_import(build, pool, tmp_path):
    """KDA, NoPE MLA and the biased MoE imported for TP=2, EP=2 and TP=2 x EP=2 and run on two
    gloo ranks give transformers' logits, and the export gathered from TP=2 x EP=2 loads in
    transformers with them too (the worker is tests/test_convert_qwen.py's)."""
    import torch

    from megamoe.convert import import_hf
    from megamoe.diagnostics.verify import load_hf_model
    from tests.conversion_harness import ATOL
    from tests.test_convert_qwen import LAYOUTS, parallel_case

    hf = build()
    hf.save_pretrained(tmp_path / "hf")
    for name, parallel in LAYOUTS.items():
        import_hf(tmp_path / "hf", tmp_path / name, progress=False, **parallel)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        for rank, errs in enumerate(pool(2).run(parallel_case, str(tmp_path), ids, want)):
            assert set(errs) == set(LAYOUTS) and max(errs.values()) <= ATOL, (rank, errs)
        exported = load_hf_model(tmp_path / "tp2ep2_hf_rank0")
        assert (exported(input_ids=ids).logits - want).abs().max() <= ATOL
