"""YaRN RoPE scaling on softmax attention (A, S): config mapping from/to HF ``rope_scaling`` /
``rope_parameters`` for the families with GQA attention, and parity with transformers.

- qwen3 and qwen3_next (partial rotary): the whole conversion round trip with YaRN (logits equal
  transformers' within 1e-4, exported config reloads, greedy decoding identical);
- qwen3_moe and mixtral: cos/sin equal the family's transformers rotary embedding, and the
  config maps back to the same rope_parameters.
(MLA's YaRN — M, D, I — is tested against transformers in tests/test_mla.py and test_dsa.py.)
"""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import YarnConfig
from megamoe.convert.family import get_family
from megamoe.core.errors import ConfigError
from megamoe.layers.rotary import cached_yarn_cos_sin
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import randomize, tiny_model

# original_max_position 16 with positions up to 40: the interpolated frequencies matter
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0)
SHAPE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_hidden_layers=2, intermediate_size=40, max_position_embeddings=64)


def hf_config(family: str, **extra):
    import transformers

    classes = {"qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "qwen3_next": "Qwen3NextConfig",
               "mixtral": "MixtralConfig"}
    kw = dict(SHAPE, **extra)
    if family == "qwen3_moe":
        kw.update(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    if family == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3_next":
        kw.update(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  layer_types=["linear_attention", "full_attention"])
    return getattr(transformers, classes[family])(**kw)


def hf_rotary(family: str, config):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "qwen3_next": "Qwen3Next", "mixtral": "Mixtral"}[family]
    return getattr(module, f"{name}RotaryEmbedding")(config)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_next", "mixtral"])
def test_cos_sin_match_transformers_yarn(family):
    rope = dict(YARN, partial_rotary_factor=0.5) if family == "qwen3_next" else YARN
    config = hf_config(family, rope_parameters=rope)
    cfg = get_family(family).config_from_hf(config.to_dict())
    a = cfg.attention
    assert a.yarn == YarnConfig(factor=4.0, original_max_position=16, mscale=0.0)
    pos = torch.arange(40).unsqueeze(0)
    want_cos, want_sin = hf_rotary(family, config)(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = cached_yarn_cos_sin(ForwardInfo(positions=pos), a.rotary_dim(cfg.hidden_size), a.rope_theta, a.yarn)
    assert cos.shape == want_cos.shape
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-6)
    assert want_cos.abs().max() > 1.01  # the attention factor scales cos/sin (0.1 ln 4 + 1)
    back = get_family(family).config_to_hf(cfg, None)["rope_parameters"]
    assert {k: back[k] for k in YARN} == YARN and "mscale" not in back


def test_legacy_rope_scaling_is_read():
    """Hub configs written before transformers 5 carry ``rope_scaling`` with ``type``."""
    hf = dict(hf_config("qwen3").to_dict(), rope_scaling={"type": "yarn", "factor": 8.0,
                                                         "original_max_position_embeddings": 32})
    hf.pop("rope_parameters")
    cfg = get_family("qwen3").config_from_hf(hf)
    assert cfg.attention.yarn == YarnConfig(factor=8.0, original_max_position=32, mscale=0.0)
    back = get_family("qwen3").config_to_hf(cfg, hf)
    assert "rope_scaling" not in back and back["rope_parameters"]["rope_type"] == "yarn"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_round_trip_with_yarn(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.conversion_harness import check_round_trip

    rope = dict(YARN, partial_rotary_factor=0.5) if family == "qwen3_next" else YARN
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(family, rope_parameters=rope))
    randomize(model, 0, std=0.1)
    check_round_trip(model, tmp_path, layouts=False)


def test_yarn_with_mrope_is_refused():
    cfg = tiny_model()
    cfg.attention.mrope_section = [1, 1, 0]
    cfg.attention.yarn = YarnConfig(factor=2.0)
    with pytest.raises(ConfigError, match=r"model.attention.yarn.factor"):
        cfg.attention.validate(cfg.hidden_size)
