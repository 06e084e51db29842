"""Kimi-K2.5 (``kimi_k25``): a deepseek_v3 text model under MoonViT (megamoe.vision.kimi_vit).

A tiny random ``Kimi_K25ForConditionalGeneration`` (vision: 2 blocks, 4-pixel patches, a 6x6
position grid that images are resampled from; text: MLA, one dense layer then 8 experts top-2 +
a shared expert, group-limited) goes through tests/conversion_harness.py's round trip in both of
transformers' layouts, then with images: logits, greedy decoding, every gradient, the hub layout
(fused ``wqkv`` with MoonViT's interleaved rope rows), TP=2 x EP=2 on two gloo ranks, and a
50-step LoRA fine-tune with the router frozen bitwise.
"""
from __future__ import annotations

import pytest
import torch

from tests.conversion_harness import ATOL
from tests.mixer_utils import randomize
from tests.numerics import max_abs
from tests.presets import show_model_counts
from tests.vlm_harness import (GRAD_REL, check_images, check_lora_steps, check_parallel_images, grad_errors,
                               prompts)

IMAGE_TOKEN = 100
PATCH = 4
TEXT = dict(model_type="deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, rope_interleave=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION = dict(patch_size=PATCH, pos_emb_height=6, pos_emb_width=6, num_attention_heads=2, num_hidden_layers=2,
              hidden_size=16, intermediate_size=24, rope_parameters=dict(rope_type="axial", rope_theta=10000.0))


def tiny_kimi_k25(tie: bool = False, seed: int = 0):
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    cfg = Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=16, image_token_id=IMAGE_TOKEN,
                         tie_word_embeddings=tie)
    model = Kimi_K25ForConditionalGeneration(cfg)
    randomize(model, seed, std=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a forgotten bias changes the experts picked
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen))
    return model.float().eval()


def image_inputs():
    """Two prompts, three images: 24x24 (the native 6x6 grid: 3x3 tokens), 16x40 and 8x32 (grids
    resampled from it: 2x5 and 1x4 tokens)."""
    from megamoe.vision.hf_kimi import images_to_pixel_values

    ids, images = prompts(((24, 24), (16, 40), (8, 32)), ((0, 2, 11), (0, 13, 23), (1, 5, 9)), IMAGE_TOKEN)
    pv, thw = zip(*(images_to_pixel_values(img[None], PATCH) for img in images))
    return ids, images, dict(input_ids=ids, pixel_values=torch.cat(pv), image_grid_thw=torch.cat(thw))


def test_config_round_trip_and_hub_spelling():
    """HF config -> megamoe -> HF config reads back the same; the hub's remote-code vision
    spelling (vt_*, init_pos_emb_*, media_placeholder_token_id) reads as transformers'."""
    from transformers import AutoConfig

    from megamoe.convert.family import get_family

    family = get_family("kimi_k25")
    hf = tiny_kimi_k25().config.to_dict()
    cfg = family.config_from_hf(hf)
    assert cfg.layout == "MdMe" and cfg.vision.encoder == "kimi_k25_vit_enc" and cfg.vision.projector_norm_eps == 1e-5
    written = family.config_to_hf(cfg, None)
    assert family.config_from_hf(AutoConfig.for_model(**written).to_dict()) == cfg
    hub = dict(hf, media_placeholder_token_id=IMAGE_TOKEN, projection_layer_norm_eps=None, image_token_id=None)
    hub["text_config"] = dict(hf["text_config"], model_type="kimi_k2")
    hub["vision_config"] = {"patch_size": PATCH, "init_pos_emb_height": 6, "init_pos_emb_width": 6,
                            "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 16,
                            "vt_intermediate_size": 24, "merge_kernel_size": [2, 2], "projector_ln_eps": 1e-5}
    assert family.config_from_hf(hub) == cfg


@torch.no_grad()
def test_round_trip_with_images(tmp_path):
    """Both saved layouts import (logits, greedy decoding, export loads in transformers); with
    images the import and the export reproduce transformers' logits and greedy tokens."""
    from megamoe.diagnostics.verify import load_hf_model
    from tests.conversion_harness import check_round_trip, load_converted

    hf = tiny_kimi_k25()
    check_round_trip(hf, tmp_path)
    ids, images, hf_inputs = image_inputs()
    for layout in ("hf_per_expert", "hf_stacked"):
        check_images(hf, load_converted(tmp_path / f"{layout}_megamoe"), ids, images, hf_inputs)
    exported = load_hf_model(tmp_path / "hf_stacked_back")
    assert max_abs(exported(**hf_inputs).logits, hf(**hf_inputs).logits) <= ATOL


def test_hub_layout_and_tied_embeddings(tmp_path):
    """An export is in the released checkpoints' names (fused wqkv whose q/k rows are MoonViT's
    interleaved rope pairs, language_model.model.layers, mm_projector.proj.0/2); transformers loads
    it to the same tensors, and a model with tied embeddings round-trips too."""
    from safetensors import safe_open

    from megamoe.convert import export_hf, import_hf
    from megamoe.diagnostics.verify import load_hf_model
    from tests.conversion_harness import load_converted

    hf = tiny_kimi_k25(tie=True)
    hf.save_pretrained(tmp_path / "hf", save_original_format=False)
    back = export_hf(import_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False), tmp_path / "back", progress=False)
    names = set()
    for f in back.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    assert {"vision_tower.encoder.blocks.1.wqkv.weight", "vision_tower.patch_embed.pos_emb.weight",
            "mm_projector.proj.0.weight", "language_model.model.layers.1.mlp.experts.7.down_proj.weight"} <= names
    assert not any(n.startswith("model.") or "lm_head" in n for n in names)
    reloaded = load_hf_model(back).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in hf.state_dict().items())
    ids, images, hf_inputs = image_inputs()
    with torch.no_grad():
        assert max_abs(load_converted(tmp_path / "ckpt")(ids, images), hf(**hf_inputs).logits) <= ATOL


def test_every_gradient_matches_transformers(tmp_path):
    from megamoe.convert import from_hf

    hf = tiny_kimi_k25()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf").eval()
    ids, images, hf_inputs = image_inputs()
    errs = grad_errors(hf, ours, "kimi_k25", ids, images, hf_inputs)
    assert any(n.startswith("vision.encoder.") for n in errs) and any(".experts." in n for n in errs)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= GRAD_REL, (worst, errs[worst])


LAYOUTS = {"tp2ep2": dict(tp=2, ep=2)}


def test_tp2_ep2_with_images_equals_one_process(pool, tmp_path):
    ids, images, hf_inputs = image_inputs()
    check_parallel_images(tiny_kimi_k25(), tmp_path, pool, LAYOUTS, ids, images, hf_inputs)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_lora_finetune_lowers_loss_with_frozen_routing(tmp_path):
    """50 LoRA steps on an image prompt (adapters on every linear role and expert): the loss
    falls and every router weight and selection bias stays bitwise."""
    ids, images, _ = image_inputs()
    check_lora_steps(tiny_kimi_k25(), tmp_path, ids, images)


def test_released_size_preset_counts_on_meta():
    """megamoe/recipes/kimi_k25.yaml: megamoe-show-model prints it from a fresh process in < 30 s and < 2 GiB,
    and its counts equal a hand count (the language model as moe_1t's, MoonViT and the merger by
    their formulas); the language model's 32.9B active and the tower's 417M are the release's
    "32B active" and "MoonViT 400M"."""
    from megamoe.core.config import validate_model_parallel
    from megamoe.recipe import load_recipe
    from tests.test_moe import hand_count_moe_1t

    out = show_model_counts("kimi_k25")  # megamoe-show-model --config kimi_k25, fresh process
    recipe = load_recipe("kimi_k25")
    validate_model_parallel(recipe.model, recipe.parallel)
    lm_total, lm_active = hand_count_moe_1t(recipe.model)
    d, depth, f, p, (gh, gw) = 1152, 27, 4304, 14, (64, 64)
    tower = 3 * p * p * d + d + gh * gw * d + depth * (4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d) + 2 * d
    k2d, h = 4 * d, recipe.model.hidden_size
    merger = 2 * d + k2d * k2d + k2d + k2d * h + h
    assert tower == 416_866_032 and 30e9 < lm_active < 33e9 and 1.0e12 < lm_total < 1.03e12
    assert out["total"] == lm_total + tower + merger == 1_026_879_376_368
    assert out["active"] == pytest.approx(lm_active + tower + merger, rel=1e-12)
    assert out["seconds"] < 30 and out["rss_mib"] < 2048, out


@torch.no_grad()
def test_fp8_release_imports_with_transformers_logits(tmp_path):
    """Kimi-K2.5 ships FP8 (e4m3 + float32 weight_scale_inv per 128x128 block) like DeepSeek-V3: the
    family table needs nothing of its own; with images the import equals transformers' FP8 model."""
    from safetensors.torch import load_file, save_file
    from transformers import Kimi_K25ForConditionalGeneration

    from megamoe.convert import from_hf
    from tests.fp8_utils import quantize_like_release

    hf = tiny_kimi_k25()
    hf.save_pretrained(tmp_path / "hf")  # the release's names: transformers writes 'blocks' for its 'layers'
    file = next((tmp_path / "hf").glob("*.safetensors"))
    save_file({k.replace("language_model.model.blocks.", "language_model.model.layers."): v
               for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    quantised = quantize_like_release(tmp_path / "hf", tmp_path / "fp8")
    assert any(".experts." in n for n in quantised) and any("self_attn" in n for n in quantised)
    ids, images, hf_inputs = image_inputs()
    want = Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()(
        **hf_inputs).logits
    assert max_abs(want, hf(**hf_inputs).logits) > 0.1  # the quantisation shows
    assert max_abs(from_hf(tmp_path / "fp8")(ids, images), want) <= ATOL
