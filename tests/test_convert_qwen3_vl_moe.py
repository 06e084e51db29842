"""Qwen3-VL-MoE (``qwen3_vl_moe``): Qwen3-MoE text with interleaved M-RoPE under Qwen3-VL's ViT
(timm qwen3_vit) with DeepStack mergers.

A tiny random ``Qwen3VLMoeForConditionalGeneration`` (text: layers e, e, d with 4 experts top-2;
vision: 3 blocks, patch 4, a 6x6 position grid, deepstack from blocks 0 and 2, so LM layers 0
and 1 get image features) goes through the round trip of tests/conversion_harness.py, then with
images: logits, greedy decoding, every gradient, the hub's expert orientation, TP=2 x EP=2 with
sequence parallelism on two gloo ranks, and a 50-step LoRA fine-tune with frozen routers.
"""
from __future__ import annotations

import torch

from tests.conversion_harness import ATOL
from tests.mixer_utils import randomize
from tests.numerics import max_abs
from tests.presets import show_model_counts
from tests.vlm_harness import (GRAD_REL, check_images, check_lora_steps, check_parallel_images, grad_errors,
                               prompts)

IMAGE_TOKEN = 100
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[2], pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True))
VISION = dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, out_hidden_size=32,
              num_position_embeddings=36, deepstack_visual_indexes=[0, 2])


def tiny_qwen3_vl_moe(seed: int = 0):
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    cfg = Qwen3VLMoeConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_TOKEN, video_token_id=101,
                           vision_start_token_id=102, vision_end_token_id=103, tie_word_embeddings=False)
    model = Qwen3VLMoeForConditionalGeneration(cfg)
    randomize(model, seed, std=0.1)
    return model.float().eval()


def image_inputs():
    """Two prompts, three images: 24x24 (the native 6x6 grid: 3x3 tokens), 16x40 and 8x16 (grids
    resampled from it: 2x5 and 1x2 tokens)."""
    from megamoe.vision.hf_qwen import images_to_pixel_values

    # prompts end in text: transformers' generate mis-positions the tokens after a prompt that ends
    # on an image placeholder (its own forward disagrees with it there)
    ids, images = prompts(((24, 24), (16, 40), (8, 16)), ((0, 2, 11), (0, 13, 23), (1, 5, 7)), IMAGE_TOKEN)
    pv, thw = zip(*(images_to_pixel_values(img[None], patch_size=4, merge_size=2) for img in images))
    return ids, images, dict(input_ids=ids, pixel_values=torch.cat(pv), image_grid_thw=torch.cat(thw),
                             mm_token_type_ids=(ids == IMAGE_TOKEN).int())


def test_config_round_trip():
    from transformers import AutoConfig

    from megamoe.convert.family import get_family

    family = get_family("qwen3_vl_moe")
    cfg = family.config_from_hf(tiny_qwen3_vl_moe().config.to_dict())
    assert cfg.layout == "AeAeAd" and cfg.attention.mrope_section == [4, 2, 2] and cfg.moe.norm_topk_prob
    assert cfg.vision.encoder.startswith("qwen3_vit_") and cfg.vision.deepstack_layers == [0, 2]
    written = family.config_to_hf(cfg, None)
    assert family.config_from_hf(AutoConfig.for_model(**written).to_dict()) == cfg


@torch.no_grad()
def test_round_trip_with_images_and_hub_expert_orientation(tmp_path):
    """Both saved layouts round-trip; with images the import and the export reproduce transformers'
    logits and greedy tokens (deepstack included). The export holds the hub's expert orientation
    ([E, h, 2F], [E, F, h]), which imports again to the same model."""
    from safetensors import safe_open

    from megamoe.convert import import_hf
    from megamoe.diagnostics.verify import load_hf_model
    from tests.conversion_harness import check_round_trip, load_converted

    hf = tiny_qwen3_vl_moe()
    check_round_trip(hf, tmp_path)
    ids, images, hf_inputs = image_inputs()
    ours = load_converted(tmp_path / "hf_per_expert_megamoe")
    check_images(hf, ours, ids, images, hf_inputs)
    want = hf(**hf_inputs).logits
    for merger in ours.vision.deepstack:  # the deepstack features matter: without them the logits move
        merger.fc2.weight.zero_(), merger.fc2.bias.zero_()
    assert max_abs(ours(ids, images), want) > 0.1
    assert max_abs(load_hf_model(tmp_path / "hf_stacked_back")(**hf_inputs).logits, want) <= ATOL
    with safe_open(str(next((tmp_path / "hf_stacked_back").glob("*.safetensors"))), "pt") as f:
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [4, 32, 48]
        assert f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape() == [4, 24, 32]
    again = load_converted(import_hf(tmp_path / "hf_stacked_back", tmp_path / "again", progress=False))
    assert max_abs(again(ids, images), want) <= ATOL


def test_every_gradient_matches_transformers(tmp_path):
    from megamoe.convert import from_hf

    hf = tiny_qwen3_vl_moe()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf").eval()
    ids, images, hf_inputs = image_inputs()
    # HF's Conv3d over T=2 identical frames: each frame's kernel gets the Conv2d's whole gradient
    errs = grad_errors(hf, ours, "qwen3_vl_moe", ids, images, hf_inputs,
                       scale={"vision.encoder.model.patch_embed.proj.weight": 0.5})
    assert any(n.startswith("vision.deepstack.") for n in errs) and any(".experts." in n for n in errs)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= GRAD_REL, (worst, errs[worst])


LAYOUTS = {"tp2ep2-sp": dict(tp=2, ep=2, sequence_parallel=True)}


def test_tp2_ep2_sp_with_images_equals_one_process(pool, tmp_path):
    ids, images, hf_inputs = image_inputs()
    check_parallel_images(tiny_qwen3_vl_moe(), tmp_path, pool, LAYOUTS, ids, images, hf_inputs)


def test_lora_finetune_lowers_loss_with_frozen_routing(tmp_path):
    """50 LoRA steps on an image prompt: the loss falls, every router stays bitwise."""
    ids, images, _ = image_inputs()
    check_lora_steps(tiny_qwen3_vl_moe(), tmp_path, ids, images)


def test_released_size_preset_counts_on_meta():
    """megamoe/recipes/qwen3_vl_moe_235b.yaml: megamoe-show-model prints it from a fresh process (< 30 s, < 2 GiB),
    counts equal to a hand count (the tower's from timm on meta, the mergers by their formula); the
    language model's 235.1B total / 22.2B active are the release's "235B / 22B"."""

    import pytest
    import timm

    from megamoe.recipe import load_recipe

    out = show_model_counts("qwen3_vl_moe_235b")  # megamoe-show-model --config qwen3_vl_moe_235b, fresh process
    m = load_recipe("qwen3_vl_moe_235b").model
    h, a, e, n = m.hidden_size, m.attention, m.moe, m.parsed_layout().num_layers
    q, kv = a.num_heads * a.head_dim, a.kv_heads() * a.head_dim
    attention = h * q + 2 * h * kv + q * h + 2 * a.head_dim + 2 * h      # q, k, v, o, q/k norms, layer norms
    routed = 3 * e.num_experts * h * e.moe_ffn_hidden_size
    lm_total = n * (attention + e.num_experts * h + routed) + 2 * m.vocab_size * h + h
    lm_active = lm_total - n * routed * (1 - e.top_k / e.num_experts)
    with torch.device("meta"):
        tower = sum(p.numel() for name, p in timm.create_model(m.vision.encoder, pretrained=False,
                                                               out_features=h).named_parameters()
                    if not name.startswith("merger."))
    d4 = 4 * 1152
    merger = 2 * 1152 + d4 * d4 + d4 + d4 * h + h
    deepstack = 3 * (2 * d4 + d4 * d4 + d4 + d4 * h + h)
    assert 234e9 < lm_total < 236e9 and 21.5e9 < lm_active < 22.5e9
    assert out["total"] == lm_total + tower + merger + deepstack
    assert out["active"] == pytest.approx(lm_active + tower + merger + deepstack, rel=1e-12)
    assert out["seconds"] < 30 and out["rss_mib"] < 2048, out


def test_deepstack_config_errors_are_one_line():
    """Deepstack layers must ascend and come with the merger projector; the stage that holds the
    tower must hold the LM layers the features are added after."""
    import dataclasses

    import pytest

    from megamoe.convert.family import get_family
    from megamoe.core.errors import ConfigError
    from megamoe.model.multimodal import MultimodalModel

    cfg = get_family("qwen3_vl_moe").config_from_hf(tiny_qwen3_vl_moe().config.to_dict())
    for vision, message in ((dict(deepstack_layers=[2, 0]), "ascending, each once"),
                            (dict(projector="mlp"), "deepstack mergers come with projector=merger")):
        bad = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, **vision))
        with pytest.raises(ConfigError, match=message) as err:
            bad.validate()
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"must hold LM layers 0\.\.1"):
        MultimodalModel(cfg, layer_ids=[1, 2], pre_process=True, post_process=True, device="meta")
