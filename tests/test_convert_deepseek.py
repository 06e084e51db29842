"""Conversion of deepseek_v3 (MLA + sigmoid group-limited MoE) and deepseek_v32 (+ DSA indexer):
the round trip of tests/conversion_harness.py on tiny random models, and the router's
selection bias (``e_score_correction_bias``), which must reach megamoe's ``router.expert_bias``."""
from __future__ import annotations

import pytest
import torch

from tests.mixer_utils import TOKENS, YARN, randomize

SHAPE = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
             v_head_dim=5, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, rms_norm_eps=1e-5, **TOKENS)


def randomized(model, seed: int = 0):
    """Weights of order one (N(0, 0.2), norms around 1) and a selection bias of the size of the
    sigmoid scores' spread, so a forgotten bias changes which experts are picked."""
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen))
    return model.eval()


def tiny_deepseek_v3(seed: int = 0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, rope_interleave=True,
                           rope_parameters=dict(YARN, original_max_position_embeddings=16), **SHAPE)
    return randomized(DeepseekV3ForCausalLM(cfg), seed)


def tiny_deepseek_v32(seed: int = 0):
    """Indexer weights made positive (as tests/test_dsa.py does): keys scoring exactly 0 tie, and
    torch.topk orders ties unspecified; 8 indexer heads keep the selection off them."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = DeepseekV32Config(num_hidden_layers=2, mlp_layer_types=["sparse", "dense"], index_topk=6, index_head_dim=8,
                            index_n_heads=8, rope_parameters=dict(YARN, original_max_position_embeddings=16), **SHAPE)
    model = randomized(DeepseekV32ForCausalLM(cfg), seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.indexer.weights_proj.weight.abs_()
    return model


def test_deepseek_v3_round_trip(tmp_path):
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_deepseek_v3(), tmp_path)


def test_deepseek_v32_round_trip(tmp_path):
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_deepseek_v32(), tmp_path)


@torch.no_grad()
def test_expert_bias_is_mapped_and_changes_results(tmp_path):
    """The imported model holds HF's bias as router.expert_bias; without it the logits move far
    beyond the round trip's tolerance (so the round trip would catch an unmapped bias)."""
    from megamoe.convert import from_hf

    hf = tiny_deepseek_v3()
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    want = hf(input_ids=ids).logits
    bias = model.layers["1"].mlp.router.expert_bias
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    bias.zero_()
    assert (model(ids) - want).abs().max() > 1e-2


def test_incomplete_mtp_layer_and_layers_beyond_are_errors(tmp_path):
    """A checkpoint without MTP tensors converts without MTP (transformers saves none though its
    config counts one); part of an MTP layer names the first tensor missing, and a tensor of a
    layer beyond the MTP layers is still an unmapped-tensor error. (The whole MTP layer converts:
    tests/test_mtp_convert.py.)"""
    from safetensors.torch import save_file

    from megamoe.convert import from_hf
    from megamoe.core.errors import CheckpointError

    hf = tiny_deepseek_v3()
    hf.save_pretrained(tmp_path)
    ids = torch.arange(8)[None]
    model = from_hf(tmp_path)
    assert model.config.mtp is None
    with torch.no_grad():
        assert (model(ids) - hf(input_ids=ids).logits).abs().max() <= 1e-4
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(32, 64)}, tmp_path / "mtp.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor model.layers.2.\w+.weight \(for mtp.0.\w+.weight\) is missing"):
        from_hf(tmp_path)
    (tmp_path / "mtp.safetensors").unlink()
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(32, 64)}, tmp_path / "beyond.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.3.eh_proj.weight is not mapped"):
        from_hf(tmp_path)


HUB_V3 = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
              qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, n_routed_experts=8, n_shared_experts=1,
              num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=3, max_position_embeddings=640,
              rope_theta=10000, scoring_func="sigmoid", topk_method="noaux_tc",
              rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 16, "beta_fast": 32,
                            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def test_hub_config_reader():
    """A config.json as DeepSeek publishes it (legacy rope_scaling, no rope_interleave); RoPE
    variants megamoe's YaRN does not implement are refused by name."""
    from megamoe.core.config import YarnConfig
    from megamoe.convert.family import get_family
    from megamoe.core.errors import CheckpointError

    cfg = get_family("deepseek_v3").config_from_hf(HUB_V3)
    assert cfg.parsed_layout().compact() == "MdMdMdMe"
    assert cfg.mla.rope == "interleaved" and cfg.mla.latent_norm_eps == 1e-6
    assert cfg.mla.yarn == YarnConfig(factor=40.0, original_max_position=16, mscale=1.0, mscale_all_dim=1.0)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.n_group, m.topk_group, m.score_function, m.expert_bias, m.shared_ffn()) == \
        (8, 2, 4, 2, "sigmoid", True, 16)
    for rope, field in (({"type": "yarn", "factor": 4, "original_max_position_embeddings": 16, "truncate": False},
                         "rope_parameters.truncate=False"), ({"rope_type": "longrope"}, "rope_type='longrope'")):
        with pytest.raises(CheckpointError, match=field):
            get_family("deepseek_v3").config_from_hf(dict(HUB_V3, rope_scaling=rope))


def test_inexpressible_export_is_a_one_line_error():
    """An export must not silently change the model: what DeepseekV3 cannot hold is refused."""
    import dataclasses

    from megamoe.convert.family import get_family
    from megamoe.core.errors import CheckpointError

    family = get_family("deepseek_v3")
    cfg = family.config_from_hf(HUB_V3)
    cases = {"moe.expert_bias": dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_bias=False)),
             "layout": dataclasses.replace(cfg, layout="MdMeMdMe"),
             "mla.latent_norm_eps": dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, latent_norm_eps=1e-5))}
    for field, bad in cases.items():
        with pytest.raises(CheckpointError, match=f"model.{field}=") as e:
            family.config_to_hf(bad, HUB_V3)
        assert "\n" not in str(e.value)
    back = family.config_to_hf(cfg, HUB_V3)
    assert "rope_scaling" not in back and back["rope_parameters"]["rope_type"] == "yarn"
    assert family.config_from_hf(back) == cfg
