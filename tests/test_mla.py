"""Multi-head latent attention (M): decoding, RoPE variants, YaRN, parity with transformers'
kimi_linear, DeepSeek-V3 and Ling (bailing_hybrid) MLA modules."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megamoe.core.config import MLAConfig, YarnConfig
from megamoe.core.errors import ConfigError
from megamoe.layers.rotary import (apply_rotary, apply_rotary_interleaved, rope_cos_sin, yarn_cos_sin_scale,
                                   yarn_softmax_scale)
from tests.mixer_utils import (HF_SHAPE, MLA_NAMES, YARN, build_mixer, causal_additive_mask, decode_steps,
                               full_forward, load_from_hf, randomize, tiny_model)
from tests.numerics import max_abs, rel_err

REL = 1e-5



def mla_model(**mla):
    cfg = tiny_model("Md", norm_zero_centered=False, norm_eps=1e-6)
    cfg.mla = dataclasses.replace(cfg.mla, **mla)
    return cfg


@pytest.mark.parametrize("rope", ["interleaved", "half", "none"])
@pytest.mark.parametrize("prefill", [0, 4])
def test_decoding_equals_full_forward(rope, prefill):
    """Decoding attends in the absorbed form over cached latents; the full forward expands heads."""
    mixer = build_mixer("M", mla_model(rope=rope))
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(decode_steps(mixer, x, prefill), full_forward(mixer, x)) <= REL


def test_interleaved_rope_rotates_pairs():
    """(x0, x1) pairs rotated by one angle each (DeepSeek's layout), output de-interleaved."""
    x = torch.randn(1, 3, 2, 8, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(3)[None], 8, 100.0)
    pairs = torch.view_as_complex(x.view(1, 3, 2, 4, 2).contiguous())
    angles = torch.polar(torch.ones(1, 3, 1, 4, dtype=torch.float64), torch.acos(cos[..., :4].double()).unsqueeze(2))
    angles = torch.where(sin[..., :4].unsqueeze(2) < 0, angles.conj(), angles)
    want = torch.view_as_real(pairs * angles)  # [..., 4, 2]: (even, odd) of each rotated pair
    got = apply_rotary_interleaved(x, cos, sin)
    assert max_abs(got, torch.cat([want[..., 0], want[..., 1]], dim=-1)) <= 1e-6
    assert max_abs(apply_rotary(x, cos, sin)[..., :4], got[..., :4]) > 1e-3  # not the rotate-half result


def test_yarn_softmax_and_cos_scales():
    """DeepSeek-V3's setting (factor 40, mscale = mscale_all_dim = 1): cos/sin unscaled, the
    softmax scale times (0.1 ln 40 + 1)^2; without mscale_all_dim the softmax scale is kept."""
    y = YarnConfig(factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    assert yarn_cos_sin_scale(y) == 1.0 and abs(yarn_softmax_scale(y) - (0.1 * math.log(40.0) + 1) ** 2) < 1e-12
    assert yarn_softmax_scale(YarnConfig(factor=4.0)) == 1.0


def hf_run(hf, x, rotary=None):
    hf.config._attn_implementation = "eager"
    pos = torch.arange(x.size(1))[None].expand(x.size(0), -1)
    mask = causal_additive_mask(x.size(0), x.size(1))
    kw = {"position_embeddings": rotary(x, pos)} if rotary is not None else {}
    with torch.no_grad():
        return hf(hidden_states=x, attention_mask=mask, **kw)[0]


def compare(hf, ours, x, rotary=None):
    randomize(hf)
    load_from_hf(ours, hf, MLA_NAMES)
    with torch.no_grad():
        got = full_forward(ours, x)
    return max_abs(got, hf_run(hf, x, rotary))


def test_matches_kimi_linear_mla():
    """Kimi: no query latent, k_rope channels not rotated (NoPE)."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    hf = KimiLinearAttention(KimiLinearConfig(q_lora_rank=None, layer_types=["full_attention"], **HF_SHAPE), 0)
    ours = build_mixer("M", mla_model(q_lora_rank=None, rope="none", yarn=YarnConfig(), indexer=None))
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    names = dict(MLA_NAMES, **{"linear_q.weight": "q_proj.weight"})
    randomize(hf)
    load_from_hf(ours, hf, names)
    with torch.no_grad():
        assert max_abs(full_forward(ours, x), hf_run(hf, x)) <= 1e-5


def test_matches_deepseek_v3_mla_rotate_half_yarn():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    cfg = DeepseekV3Config(q_lora_rank=12, rope_interleave=False, rope_parameters=YARN, **HF_SHAPE)
    ours = build_mixer("M", mla_model(rope="half"))
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    assert compare(m.DeepseekV3Attention(cfg, 0), ours, x, m.DeepseekV3RotaryEmbedding(cfg)) <= 1e-5


def test_matches_ling_mla_interleaved_head_gate():
    from transformers import BailingHybridConfig
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as m

    cfg = BailingHybridConfig(q_lora_rank=12, rope_parameters=dict(YARN, rope_theta=600.0), **HF_SHAPE)
    ours = build_mixer("M", mla_model(head_gate=True, rope_theta=600.0))
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3))
    assert compare(m.BailingHybridAttention(cfg, 0), ours, x, m.BailingHybridRotaryEmbedding(cfg)) <= 1e-5


@pytest.mark.parametrize("field,value,needle", [
    ("qk_rope_head_dim", 3, "model.mla.qk_rope_head_dim=3"),
    ("rope", "yarn", "model.mla.rope='yarn'"),
    ("q_lora_rank", None, "model.mla.q_lora_rank=None is invalid: must be set when mla.indexer is"),
    ("yarn", YarnConfig(factor=0.5), "model.mla.yarn.factor=0.5"),
])
def test_bad_config_one_line_error(field, value, needle):
    cfg = dataclasses.replace(MLAConfig(indexer=tiny_model().mla.indexer), **{field: value})
    with pytest.raises(ConfigError) as e:
        cfg.validate(64)
    assert needle in str(e.value) and "\n" not in str(e.value)
