"""GLM-5 (glm_moe_dsa: MLA + DSA with shared-indexer layers, dense-then-MoE, group-limited
routing), MiniMax-M2 and MiniMax-M3-VL against transformers on tiny random configs: the round
trip of tests/conversion_harness.py (logits, export, 16 greedy tokens), every gradient
(tests/family_checks.py), TP=2 x EP=2 and CP=2 equal one process, 50 LoRA steps with frozen routing."""
from __future__ import annotations

import pytest
import torch

from tests.family_checks import (assert_gradients_match, assert_lora_trains, assert_parallel_equals_single, batch,
                                 hf_gradient_errors, lora_case, parallel_grads_case)
from tests.presets import show_model_counts

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


def tiny_minimax_m3_vl():
    """Layers: full attention + dense MLP, block-sparse attention + MoE (4 experts top-2, one
    shared, scaled by 2); SwiGLU-OAI clamped at 0.6 (the clamp bites at these weights); half of
    each head rotated; 3-key blocks, 2 kept; a one-block ViT of width 24 with a 2x2 merger."""
    from transformers import MiniMaxM3VLConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    text = dict(hidden_size=32, intermediate_size=16, dense_intermediate_size=24, shared_intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                num_experts_per_tok=2, layer_types=["full_attention", "minimax_m3_sparse"],
                mlp_layer_types=["dense", "sparse"], index_n_heads=2, index_head_dim=8, index_block_size=3,
                index_topk_blocks=2, swiglu_limit=0.6, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                **TOKENS)
    vision = dict(hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  spatial_merge_size=2)
    cfg = MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=20,
                            image_token_index=TOKENS["vocab_size"] - 1)
    model = MiniMaxM3SparseForConditionalGeneration(cfg)
    randomize(model)
    with torch.no_grad():  # Gemma norms hold weight - 1
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" in name:
                p.sub_(1.0)
    return model.eval()



def image_inputs(image_token: int):
    """Three images of different sizes in two rows (patch 4, merge 2: 10, 3 and 4 tokens):
    megamoe's (ids, images) and transformers' inputs for the same batch."""
    from megamoe.vision.hf_qwen import images_to_pixel_values

    gen = torch.Generator().manual_seed(4)
    images = [torch.randn(3, h, w, generator=gen) for h, w in ((16, 40), (24, 8), (16, 16))]
    ids = torch.randint(3, image_token, (2, 24), generator=gen)
    ids[0, 2:12] = image_token
    ids[0, 15:18] = image_token
    ids[1, 5:9] = image_token
    pv, thw = zip(*(images_to_pixel_values(img[None], patch_size=4, merge_size=2) for img in images))
    return ids, images, dict(input_ids=ids, pixel_values=torch.cat(pv), image_grid_thw=torch.cat(thw))


@torch.no_grad()
def test_minimax_m3_vl_round_trip_with_images(tmp_path):
    """Text round trip (both layouts, export, 16 greedy tokens), then an image prompt: the
    imported model and the exported checkpoint reproduce transformers' logits, and greedy
    decoding after the images equals transformers' generate."""
    from megamoe.diagnostics.verify import load_hf_model
    from megamoe.inference.generate import generate
    from tests.conversion_harness import ATOL, check_round_trip, load_converted

    hf = tiny_minimax_m3_vl()
    check_round_trip(hf, tmp_path)
    ours = load_converted(tmp_path / "hf_per_expert_megamoe")
    assert ours.config.parsed_layout().compact() == "AdBe" and ours.config.moe.swiglu_alpha == 1.702
    exported = load_hf_model(tmp_path / "hf_stacked_back")
    ids, images, hf_inputs = image_inputs(hf.config.image_token_id)
    want = hf(**hf_inputs).logits
    assert (ours(ids, images) - want).abs().max() <= ATOL
    assert (exported(**hf_inputs).logits - want).abs().max() <= ATOL
    hf_tokens = hf.generate(**hf_inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None,
                            pad_token_id=0, suppress_tokens=[hf.config.image_token_id])
    assert torch.equal(generate(ours, ids, 16, images=images), hf_tokens)


def test_minimax_m3_vl_gradients_with_images(tmp_path):
    """Every parameter, the vision tower and projector included (their gradients through the
    table's q/k row permutation), against transformers on an image prompt."""
    hf = tiny_minimax_m3_vl()
    hf.save_pretrained(tmp_path)
    ids, images, hf_inputs = image_inputs(hf.config.image_token_id)
    hf_inputs.pop("input_ids")
    errs = hf_gradient_errors(hf, tmp_path, ids, batch(TOKENS["vocab_size"], seq=24)[1],
                              ours={"images": images}, hf=hf_inputs)
    assert any(k.startswith("vision.encoder") for k in errs) and any("indexer" in k for k in errs)
    assert_gradients_match(errs)


# ---- every family: parallel layouts and LoRA ----------------------------------------------------

BUILDERS = {"glm_moe_dsa": tiny_glm_moe_dsa, "minimax_m2": tiny_minimax_m2, "minimax_m3_vl": tiny_minimax_m3_vl}
LAYOUTS = [("glm_moe_dsa", dict(tp=2, ep=2), True), ("glm_moe_dsa", dict(cp=2), False),
           ("minimax_m2", dict(tp=2, ep=2), True), ("minimax_m3_vl", dict(tp=2, ep=2), True),
           ("minimax_m3_vl", dict(cp=2), False)]


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


# ---- presets at the released sizes ------------------------------------------------------------

def hf_meta_counts(hf_config, arch) -> dict:
    """transformers' model of ``hf_config`` built on meta: its parameters, routed-expert and
    vision (tower + projector) parameters, and selection-bias entries (buffers there, frozen
    parameters in megamoe)."""
    with torch.device("meta"):
        model = arch(hf_config)
    params = dict(model.named_parameters())

    def count(keep):
        return sum(p.numel() for n, p in params.items() if keep(n))
    return {"total": count(lambda n: True), "routed": count(lambda n: n.endswith((".experts.gate_up_proj",
                                                                                 ".experts.down_proj"))),
            "vision": count(lambda n: "vision_tower." in n or "multi_modal_projector." in n),
            "bias": sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))}


@pytest.mark.parametrize("preset", ["glm5", "minimax_m3"])
def test_released_size_presets(preset):
    """megamoe-show-model prints the preset in a fresh process in < 30 s and < 2 GiB; its total is
    transformers' parameter count of the same model (built on meta from transformers' default
    config, which is the released one) plus the selection bias (a buffer there), and its active
    count is that total less the routed experts not chosen; the release's rounded figures
    (GLM-5: 744B total, 40B active; MiniMax-M3: ~428B total, ~23B active) are the language
    model's without the embedding and output layer."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, MiniMaxM3VLConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    from megamoe.core.config import validate_model_parallel
    from megamoe.convert.family import get_family
    from megamoe.recipe import load_recipe

    recipe = load_recipe(preset)
    validate_model_parallel(recipe.model, recipe.parallel)
    cfg = recipe.model
    layers = cfg.parsed_layout().layers
    if preset == "glm5":
        hf = GlmMoeDsaConfig()
        arch, published = GlmMoeDsaForCausalLM, (744e9, 40e9)
    else:
        text = {"layer_types": ["minimax_m3_sparse"] * len(layers),
                "mlp_layer_types": ["dense" if k.mlp == "d" else "sparse" for k in layers]}
        hf = MiniMaxM3VLConfig(text_config=text, image_token_index=cfg.vision.image_token_id)
        arch, published = MiniMaxM3SparseForConditionalGeneration, (428e9, 23e9)
    assert get_family(hf.model_type).config_from_hf(hf.to_dict()).layout.replace(" ", "") == \
        cfg.parsed_layout().compact().replace("|", "")  # the preset is the converter's reading of the release
    hf_count = hf_meta_counts(hf, arch)
    total = hf_count["total"] + hf_count["bias"]
    active = total - hf_count["routed"] * (1 - cfg.moe.top_k / cfg.moe.num_experts)
    shown = show_model_counts(preset)
    assert shown["total"] == total and shown["active"] == round(active), (shown, total, active)
    lm_active = active - 2 * cfg.vocab_size * cfg.hidden_size - hf_count["vision"]
    assert abs(total - published[0]) < 0.005 * published[0], total
    assert abs(lm_active - published[1]) < 0.03 * published[1], lm_active
    assert shown["seconds"] < 30 and shown["rss_mib"] < 2048, shown
