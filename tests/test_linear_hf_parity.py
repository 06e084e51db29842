"""G and K mixers against the transformers modules, same weights (tiny random configs, fp32).

Qwen3-Next (fused in_proj_qkvz/in_proj_ba) and Qwen3.5 (separate projections) Gated DeltaNet;
kimi_linear, glm5_next (safe gate) and bailing_hybrid (full-rank gates, safe gate) KDA.
Weights go through the typed transforms of ``megamoe.convert.hf_layout``.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from tests.numerics import max_abs

HIDDEN, T, TOL = 32, 37, 1e-5


def megamoe_mixer(letter: str, **section):
    """A G or K mixer of tests.mixer_utils.tiny_model with ``section`` overrides, weights drawn
    with std 0.1 (outputs of order one) and norm weights and A_log randomised."""
    from tests.mixer_utils import build_mixer, tiny_model

    name = "gdn" if letter == "G" else "kda"
    base = tiny_model(f"{letter}d", init_std=0.1)
    setattr(base, name, dataclasses.replace(getattr(base, name), **section))
    return build_mixer(letter, base, layer_number=0)


def compare(mixer, hf_module) -> float:
    from megamoe.layers.spec import ForwardInfo

    x = torch.randn(2, T, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = mixer(x, ForwardInfo(positions=torch.arange(T).expand(2, -1)))
        theirs = hf_module(x)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    assert theirs.abs().max() > 0.1  # a real signal, not a vanishing one
    return max_abs(ours, theirs)


def gdn_parts(mixer):
    from megamoe.convert import hf_layout as L

    return {"conv1d.weight": L.conv_to_hf(mixer.conv_weight.data), "A_log": mixer.A_log.data,
            "dt_bias": mixer.dt_bias.data, "norm.weight": mixer.norm.weight.data,
            "out_proj.weight": mixer.out_proj.weight.data}


HF_GDN = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_conv_kernel_dim=4, num_hidden_layers=1,
              layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1)


def test_qwen3_next_gated_deltanet():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from megamoe.convert import hf_layout as L

    hf_cfg = Qwen3NextConfig(**HF_GDN)
    mixer = megamoe_mixer("G", norm_eps=hf_cfg.rms_norm_eps)
    hf = Qwen3NextGatedDeltaNet(hf_cfg, 0)
    qkvz, ba = L.in_proj_to_qwen3_next(mixer.in_proj.weight.data, L.GDNShapes.from_config(mixer.cfg))
    hf.load_state_dict({"in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba, **gdn_parts(mixer)}, strict=True)
    assert compare(mixer, hf) <= TOL


def test_qwen3_5_gated_deltanet():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from megamoe.convert import hf_layout as L

    hf_cfg = Qwen3_5TextConfig(**HF_GDN)
    mixer = megamoe_mixer("G", norm_eps=hf_cfg.rms_norm_eps)
    hf = Qwen3_5GatedDeltaNet(hf_cfg, 0)
    qkv, z, b, a = L.in_proj_to_qwen3_5(mixer.in_proj.weight.data, L.GDNShapes.from_config(mixer.cfg))
    hf.load_state_dict({"in_proj_qkv.weight": qkv, "in_proj_z.weight": z, "in_proj_b.weight": b,
                        "in_proj_a.weight": a, **gdn_parts(mixer)}, strict=True)
    assert compare(mixer, hf) <= TOL


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_gdn_layout_transforms_round_trip(layout):
    from megamoe.convert import hf_layout as L

    s = L.GDNShapes(key_heads=2, value_heads=6, key_head_dim=3, value_head_dim=5)
    w = torch.randn(sum(s.in_proj_parts()), 7)
    if layout == "qwen3_next":
        qkvz, ba = L.in_proj_to_qwen3_next(w, s)
        # key head 1's block in qkvz starts with its q rows, then its k rows
        assert torch.equal(qkvz[2 * 3 + 6 * 5 * 2 // 2: 2 * 3 + 6 * 5 * 2 // 2 + 3], w[3:6])
        assert torch.equal(L.qwen3_next_to_in_proj(qkvz, ba, s), w)
    else:
        assert torch.equal(L.qwen3_5_to_in_proj(*L.in_proj_to_qwen3_5(w, s), s), w)
    with pytest.raises(ValueError, match="in_proj.weight has shape"):
        L.in_proj_to_qwen3_next(w[1:], s)


def kda_state_dict(mixer, full_rank: bool, a_log_shape) -> dict:
    from megamoe.convert import hf_layout as L

    cfg = mixer.cfg
    q, k, v, b = L.in_proj_to_kda(mixer.in_proj.weight.data, cfg.num_heads, cfg.head_dim)
    sd = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "b_proj.weight": b,
          "conv1d.weight": L.conv_to_hf(mixer.conv_weight.data), "forget_gate.dt_bias": mixer.dt_bias.data,
          "forget_gate.A_log": mixer.A_log.data.reshape(a_log_shape), "o_norm.weight": mixer.norm.weight.data,
          "o_proj.weight": mixer.out_proj.weight.data}
    if full_rank:
        sd.update({"forget_gate.f_proj.weight": mixer.forget_gate.up.weight.data,
                   "g_proj.weight": mixer.output_gate.up.weight.data})
    else:
        sd.update({"forget_gate.f_a_proj.weight": mixer.forget_gate.down.weight.data,
                   "forget_gate.f_b_proj.weight": mixer.forget_gate.up.weight.data,
                   "g_a_proj.weight": mixer.output_gate.down.weight.data,
                   "g_b_proj.weight": mixer.output_gate.up.weight.data})
    return sd


def test_kimi_linear_kda():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    hf_cfg = KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=1, linear_attn_config={
        "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1], "full_attn_layers": []})
    mixer = megamoe_mixer("K", conv_kernel=4, norm_eps=hf_cfg.rms_norm_eps)
    hf = KimiLinearDeltaAttention(hf_cfg, 0)
    hf.load_state_dict(kda_state_dict(mixer, False, (1, 1, -1, 1)), strict=True)
    assert compare(mixer, hf) <= TOL


def test_glm5_next_linear_attention():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    hf_cfg = Glm5NextTextConfig(hidden_size=HIDDEN, linear_num_heads=2, linear_head_dim=8, num_hidden_layers=2,
                                layer_types=["linear_attention", "indexed_attention"], num_attention_heads=2,
                                num_key_value_heads=2, qk_rope_head_dim=0, index_topk=4, index_kpool=2,
                                vocab_size=64, pad_token_id=0)
    mixer = megamoe_mixer("K", conv_kernel=4, norm_eps=hf_cfg.rms_norm_eps,
                          gate_lower_bound=hf_cfg.linear_lower_bound)
    hf = Glm5NextTextLinearAttention(hf_cfg, 0)
    hf.load_state_dict(kda_state_dict(mixer, False, (-1,)), strict=True)
    assert compare(mixer, hf) <= TOL


def test_bailing_hybrid_linear_attention():
    from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridDeltaAttention

    hf_cfg = BailingHybridConfig(hidden_size=HIDDEN, num_attention_heads=2, head_dim=8, num_hidden_layers=1,
                                 layer_types=["linear_attention"], mlp_layer_types=["dense"])
    assert hf_cfg.kda_safe_gate
    mixer = megamoe_mixer("K", conv_kernel=4, norm_eps=hf_cfg.rms_norm_eps, gate_rank=0,
                          gate_lower_bound=hf_cfg.kda_lower_bound)
    hf = BailingHybridDeltaAttention(hf_cfg, 0)
    hf.load_state_dict(kda_state_dict(mixer, True, (-1,)), strict=True)
    assert compare(mixer, hf) <= TOL
