"""Conversion of the Qwen MoE families: qwen3_moe, qwen3_next, qwen3_5_moe_text and qwen3_5_moe
(text backbone and vision tower). Each runs the round trip of tests/conversion_harness.py on a
tiny random model; qwen3_5_moe also compares a forward and greedy decoding with an image, and
qwen3_next is imported for TP=2, EP=2 and TP=2 x EP=2 and run (and exported) on two gloo ranks.

Weights are drawn N(0, 0.1) (norms around 1): at 0.2 the tiny GDN models' own fp32 error
(transformers fp32 against fp64) already exceeds the 1e-4 tolerance.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.mixer_utils import randomize
from tests.numerics import max_abs

STD = 0.1
SHAPE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
HYBRID = dict(SHAPE, shared_expert_intermediate_size=24, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8)
ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
IMAGE_TOKEN = 100


def randomized(model, seed: int = 0):
    randomize(model, seed, std=STD)
    return model.eval()


def qwen3_moe_config():
    """Layers d, e, d (decoder_sparse_step=2); top-k weights not renormalised."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(num_hidden_layers=3, intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
                          **SHAPE)


def qwen3_next_config():
    """Layers Ge, Ae, Gd (mlp_only_layers=[2]); gated attention with partial rotary."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(num_hidden_layers=3, intermediate_size=40, mlp_only_layers=[2], rope_parameters=ROPE,
                           layer_types=["linear_attention", "full_attention", "linear_attention"], **HYBRID)


def tiny_qwen3_moe():
    from transformers import Qwen3MoeForCausalLM

    return randomized(Qwen3MoeForCausalLM(qwen3_moe_config()))


def tiny_qwen3_next():
    from transformers import Qwen3NextForCausalLM

    return randomized(Qwen3NextForCausalLM(qwen3_next_config()))


def qwen3_5_moe_text_config():
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                rope_parameters=dict(ROPE, mrope_section=[1, 1, 0]), **HYBRID)


def qwen3_5_moe_config():
    """Text layers Ge, Ae with interleaved M-RoPE over 4 rotary pairs (t, h, w = 2, 1, 1); a
    one-block vision tower (patch 4, merge 2) whose merger projects to the text width."""
    from transformers import Qwen3_5MoeConfig

    text = dict(HYBRID, vocab_size=128, head_dim=16, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"],
                rope_parameters=dict(ROPE, mrope_section=[2, 1, 1], mrope_interleaved=True))
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, out_hidden_size=32,
                  num_position_embeddings=64)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=101,
                            vision_start_token_id=102, vision_end_token_id=103)


def tiny_qwen3_5_moe_text():
    from transformers import Qwen3_5MoeForCausalLM

    return randomized(Qwen3_5MoeForCausalLM(qwen3_5_moe_text_config()))


def tiny_qwen3_5_moe():
    from transformers import Qwen3_5MoeForConditionalGeneration

    return randomized(Qwen3_5MoeForConditionalGeneration(qwen3_5_moe_config()))


def test_layouts_from_hf_configs():
    from megamoe.convert.family import get_family

    for config, layout in ((qwen3_moe_config, "AdAeAd"), (qwen3_next_config, "GeAeGd")):
        cfg = config().to_dict()
        assert get_family(cfg["model_type"]).config_from_hf(cfg).layout == layout


def test_configs_round_trip_without_the_original():
    """An export with no HF config to start from (a model trained in megamoe): transformers reads
    the written config.json back into the same megamoe config."""
    from transformers import AutoConfig

    from megamoe.convert.family import get_family
    from tests.test_convert_mixtral import mixtral_config

    configs = [qwen3_moe_config(), qwen3_next_config(), qwen3_5_moe_text_config(), qwen3_5_moe_config(),
               mixtral_config()]
    for hf_config in configs:
        family = get_family(hf_config.model_type)
        cfg = family.config_from_hf(hf_config.to_dict())
        written = family.config_to_hf(cfg, None)
        again = AutoConfig.for_model(**written).to_dict()
        assert family.config_from_hf(again) == cfg, hf_config.model_type


def test_qwen3_moe_round_trip(tmp_path):
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_qwen3_moe(), tmp_path)


def test_qwen3_next_round_trip(tmp_path):
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_qwen3_next(), tmp_path)


def test_qwen3_5_moe_text_round_trip(tmp_path):
    from tests.conversion_harness import check_round_trip

    check_round_trip(tiny_qwen3_5_moe_text(), tmp_path)


def image_inputs(image_token: int):
    """Two prompts, three images (16x40 -> 2x5 tokens, 24x8 -> 3x1, 16x16 -> 2x2): megamoe's
    (ids, images) and transformers' inputs for the same batch."""
    from megamoe.vision.hf_qwen import images_to_pixel_values

    gen = torch.Generator().manual_seed(4)
    images = [torch.randn(3, h, w, generator=gen) for h, w in ((16, 40), (24, 8), (16, 16))]
    ids = torch.randint(0, 90, (2, 24), generator=gen)
    ids[0, 2:12] = image_token
    ids[0, 15:18] = image_token
    ids[1, 5:9] = image_token
    pv, thw = zip(*(images_to_pixel_values(img[None], patch_size=4, merge_size=2) for img in images))
    hf = dict(input_ids=ids, pixel_values=torch.cat(pv), image_grid_thw=torch.cat(thw),
              mm_token_type_ids=(ids == image_token).int(), attention_mask=torch.ones_like(ids))
    return ids, images, hf


@torch.no_grad()
def test_qwen3_5_moe_vision_language_round_trip(tmp_path):
    """Text round trip (both layouts, export, greedy decoding), then with images: the imported
    model and the exported checkpoint reproduce transformers' logits, and greedy decoding after
    an image prompt is identical."""
    from megamoe.diagnostics.verify import load_hf_model
    from megamoe.inference.generate import generate
    from tests.conversion_harness import ATOL, check_round_trip, load_converted

    hf = tiny_qwen3_5_moe()
    check_round_trip(hf, tmp_path)
    ours = load_converted(tmp_path / "hf_per_expert_megamoe")
    exported = load_hf_model(tmp_path / "hf_stacked_back")
    ids, images, hf_inputs = image_inputs(hf.config.image_token_id)
    want = hf(**hf_inputs).logits
    assert max_abs(ours(ids, images), want) <= ATOL
    assert max_abs(exported(**hf_inputs).logits, want) <= ATOL
    hf_tokens = hf.generate(**hf_inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    assert torch.equal(generate(ours, ids, 16, images=images), hf_tokens)


def test_qwen3_5_moe_vision_table_mirrors_timm_filter_and_checks_depth(tmp_path):
    """The tower the table imports equals the one timm's checkpoint_filter_fn_encoder loads from
    the same file (bit for bit), and a config whose vision depth disagrees with the weights is a
    one-line error naming the missing tensor, with nothing written."""
    import json

    from megamoe.convert import from_hf, import_hf
    from megamoe.core.errors import CheckpointError
    from megamoe.vision.hf_qwen import qwen_vision_config
    from megamoe.vision.tower import VisionTower

    hf = tiny_qwen3_5_moe()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf").vision.state_dict()
    timm_loaded = VisionTower(qwen_vision_config(hf.config, weights=str(tmp_path / "hf")), out_dim=32).state_dict()
    assert ours.keys() == timm_loaded.keys() and all(torch.equal(ours[k], timm_loaded[k]) for k in ours)

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["vision_config"]["depth"] = 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor model\.visual\.blocks\.1\.norm1\.weight .* is missing") as err:
        import_hf(tmp_path / "hf", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


# ---- importing for a parallel layout (two gloo ranks) -----------------------------------------

LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2), "tp2ep2": dict(tp=2, ep=2)}


def parallel_case(root: str, ids: torch.Tensor, want: torch.Tensor) -> dict:
    """Per layout: load the converted checkpoint into a model split over the two ranks, compare
    its logits with transformers', and export it back (each rank into its own directory)."""
    import torch.distributed as dist

    from megamoe.core.config import ParallelConfig
    from megamoe.convert import build_model, to_hf
    from megamoe.parallel.groups import build_groups
    from megamoe.core.config_io import config_from_dict
    from megamoe.checkpoint.dcp import load_checkpoint, read_meta

    out = {}
    for name, parallel in LAYOUTS.items():
        path = Path(root) / name
        meta = read_meta(path)
        groups = build_groups(ParallelConfig(**parallel))
        model = build_model(config_from_dict(meta["model"]), groups).eval()
        load_checkpoint(path, groups, [model], load_rng=False)
        with torch.no_grad():
            out[name] = max_abs(model(ids), want)
        to_hf(model, Path(root) / f"{name}_hf_rank{dist.get_rank()}", family=meta["hf"]["model_type"],
              hf_config=meta["hf"]["config"], groups=groups)
    return out


@torch.no_grad()
def test_qwen3_next_parallel_import_and_export(pool, tmp_path):
    from megamoe.convert import import_hf
    from megamoe.diagnostics.verify import load_hf_model
    from tests.conversion_harness import ATOL

    hf = tiny_qwen3_next()
    hf.save_pretrained(tmp_path / "hf")
    for name, parallel in LAYOUTS.items():
        import_hf(tmp_path / "hf", tmp_path / name, progress=False, **parallel)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    want = hf(input_ids=ids).logits
    for rank, errs in enumerate(pool(2).run(parallel_case, str(tmp_path), ids, want)):
        assert set(errs) == set(LAYOUTS) and max(errs.values()) <= ATOL, (rank, errs)
    for name in LAYOUTS:
        exported = load_hf_model(tmp_path / f"{name}_hf_rank0")
        assert max_abs(exported(input_ids=ids).logits, want) <= ATOL, name


def test_export_refuses_what_hf_cannot_express(tmp_path):
    import dataclasses

    from megamoe.convert.family import get_family
    from megamoe.core.errors import CheckpointError

    hf_cfg = qwen3_next_config().to_dict()
    family = get_family("qwen3_next")
    cfg = family.config_from_hf(hf_cfg)
    for change, match in ((dict(norm_zero_centered=False), "norm_zero_centered must be true"),
                          (dict(layout="GeAeLd"), "layer 'Ld'"),
                          (dict(moe=dataclasses.replace(cfg.moe, score_function="sigmoid")), "softmax top-k")):
        with pytest.raises(CheckpointError, match=match) as err:
            family.config_to_hf(dataclasses.replace(cfg, **change), hf_cfg)
        assert "\n" not in str(err.value)
