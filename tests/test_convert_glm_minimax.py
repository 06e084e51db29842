"""Conversion of glm5_next (text model: KDA + pooled DSA, hyper-connections, clamped SwiGLU, dense
and MoE layers) and minimax (lightning + softmax attention, top-2 MoE, scaled residual): the whole
round trip of tests/conversion_harness.py in both expert layouts, plus the family-specific
inputs (glm5_next's vision tower with images, decay buffers that disagree with the config,
shared indexers)."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.core.errors import CheckpointError

TOKENS = dict(vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)
IMAGE_TOKEN = 90


@torch.no_grad()
def randomize(model, seed: int = 1) -> None:
    """Weights of order 0.2 (outputs of order one, so every block matters to the logits), norm
    weights around 1, small routing biases; the indexer's head weights positive (see tests/test_dsa.py)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1 + 0.1 * noise)
        elif name.split(".")[-1] in ("A_log", "dt_bias", "base", "scale") or "_hc." in name:
            p.add_(0.1 * noise)
        else:
            p.copy_(0.2 * noise)
        if name.endswith("indexer.weights_proj.weight"):
            p.abs_()
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def tiny_minimax():
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    torch.manual_seed(0)
    cfg = MiniMaxConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, block_size=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        full_attn_alpha_factor=0.6, full_attn_beta_factor=1.4, linear_attn_alpha_factor=1.3,
                        linear_attn_beta_factor=0.7, mlp_alpha_factor=0.8, mlp_beta_factor=1.5, **TOKENS)
    model = MiniMaxForCausalLM(cfg)
    randomize(model)
    return model


def tiny_glm5_next():
    """Layer 0: KDA + dense MLP, layer 1: indexed attention + MoE; 3 residual streams; the SwiGLU
    clamp (0.5) is active at these weight sizes; 16 indexer heads (no exact ties in the selection).
    transformers always builds the vision tower (a default-sized one without vision_config): a tiny one."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                num_experts_per_tok=2, kv_lora_rank=10, q_lora_rank=12, qk_rope_head_dim=0, v_head_dim=5,
                qk_nope_head_dim=6, index_topk=4, index_head_dim=8, index_n_heads=16, index_kpool=2,
                layer_types=["linear_attention", "indexed_attention"], mlp_layer_types=["dense", "sparse"],
                linear_head_dim=8, linear_num_heads=2, hc_mult=3, swiglu_limit=0.5, **TOKENS)
    vision_cfg = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=32,
                      projection_intermediate_size=24, patch_size=4, image_size=16)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision_cfg,
                                                            image_token_id=IMAGE_TOKEN))
    randomize(model)
    return model


def test_minimax_round_trip(tmp_path):
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_minimax(), tmp_path)


def glm_image_inputs():
    """Two prompts, two images (16x24 -> 2x3 tokens, 8x32 -> 1x4) in HF's pixel_values layout."""
    from megamoe.vision.hf_qwen import images_to_pixel_values

    gen = torch.Generator().manual_seed(4)
    images = [torch.randn(3, h, w, generator=gen) for h, w in ((16, 24), (8, 32))]
    ids = torch.randint(3, 89, (2, 16), generator=gen)
    ids[0, 2:8] = IMAGE_TOKEN
    ids[1, 9:13] = IMAGE_TOKEN
    pv, thw = zip(*(images_to_pixel_values(img[None], patch_size=4, merge_size=2) for img in images))
    return ids, images, dict(input_ids=ids, pixel_values=torch.cat(pv), image_grid_thw=torch.cat(thw))


def test_glm5_next_round_trip_with_its_vision_tower(tmp_path, caplog):
    """The tower converts (no notice, nothing skipped) into megamoe's glm5_vit_enc + glm_merger: both
    layouts round-trip; with images the import and the export give transformers' logits and greedy
    tokens, and every parameter's gradient (tower and merger included) is transformers'."""
    from megamoe.diagnostics.verify import load_hf_model
    from tests.conversion_harness import ATOL, check_round_trip, load_converted
    from tests.vlm_harness import GRAD_REL, check_images, grad_errors

    hf = tiny_glm5_next().float().eval()
    with caplog.at_level(logging.WARNING, logger="megamoe.convert.api"):
        check_round_trip(hf, tmp_path)
    assert not [r for r in caplog.records if "vision" in r.getMessage()]
    ours = load_converted(tmp_path / "hf_per_expert_megamoe")
    assert ours.config.vision.encoder == "glm5_vit_enc" and ours.config.vision.projector == "glm_merger"
    ids, images, hf_inputs = glm_image_inputs()
    check_images(hf, ours, ids, images, hf_inputs)
    with torch.no_grad():
        exported = load_hf_model(tmp_path / "hf_stacked_back")
        assert (exported(**hf_inputs).logits - hf(**hf_inputs).logits).abs().max() <= ATOL
    # HF's Conv3d over T=2 identical frames: each frame's kernel gets the Conv2d's whole gradient
    errs = grad_errors(hf, ours, "glm5_next", ids, images, hf_inputs,
                       scale={"vision.encoder.model.patch_embed.proj.weight": 0.5})
    worst = max(errs, key=errs.get)
    assert any(n.startswith("vision.projector.") for n in errs) and errs[worst] <= GRAD_REL, (worst, errs[worst])


def test_glm5_next_export_without_origin(tmp_path):
    """A model with no HF origin exports with a minimal vision config. (Its MTP layers convert
    both ways: tests/test_mtp_convert.py.)"""
    from megamoe.convert import from_hf, to_hf
    from megamoe.diagnostics.verify import load_hf_model

    hf = tiny_glm5_next().float().eval()
    hf.save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    model.hf_origin = None
    to_hf(model, tmp_path / "out", family="glm5_next")
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        assert (load_hf_model(tmp_path / "out")(input_ids=ids).logits - want).abs().max() <= 1e-4
        assert (model(ids) - want).abs().max() <= 1e-4


def test_minimax_decay_buffers_must_match_the_config(tmp_path):
    from megamoe.convert import import_hf

    tiny_minimax().save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    weights = load_file(file)
    weights["model.layers.2.self_attn.slope_rate"] *= 1.5
    save_file(weights, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.slope_rate differs") as err:
        import_hf(tmp_path / "hf", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (dict(indexer_types=["full", "shared"]), r"text_config\.indexer_types\[1\]='shared' is not supported"),
    (dict(layer_types=["linear_attention", "sliding_attention"]), r"text_config\.layer_types=.* must give one of"),
])
def test_glm5_next_config_errors(change, message):
    from megamoe.convert import get_family

    text = dict(tiny_glm5_next().config.text_config.to_dict(), **change)
    with pytest.raises(CheckpointError, match=message) as err:
        get_family("glm5_next").config_from_hf({"model_type": "glm5_next", "text_config": text})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("build", [tiny_minimax, tiny_glm5_next], ids=["minimax", "glm5_next"])
def test_parallel_import(build, pool, tmp_path):
    """Imported for TP=2, EP=2 and TP=2 x EP=2 and run on two gloo ranks: transformers' logits, and
    the exports load in transformers with them too."""
    from tests.conversion_harness import check_parallel_import

    check_parallel_import(build(), tmp_path, pool, vocab=TOKENS["vocab_size"])
