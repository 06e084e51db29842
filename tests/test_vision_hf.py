"""HF Qwen3.5-MoE parity: the vision tower in timm's qwen3_vit (+ megamoe's merger) against
transformers' ``get_image_features``, HF pixel_values <-> images, M-RoPE positions and angles.

A tiny random ``Qwen3_5MoeForConditionalGeneration`` is built once and saved, so the tower is
loaded the way users load it: from the checkpoint file, through timm's key filter, strictly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megamoe.model.multimodal import image_spans, mrope_positions
from tests.numerics import max_abs

IMAGE_TOKEN = 100
SIZES = [(32, 32), (16, 40), (24, 8)]  # multiples of patch 4 x merge 2; square, wide, tall


def hf_config():
    from transformers import Qwen3_5MoeConfig

    text = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                num_experts=4, num_experts_per_tok=2,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=64,
                  num_position_embeddings=64)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                            video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(hf_config()).eval()
    path = tmp_path_factory.mktemp("qwen35moe")
    model.save_pretrained(path)
    return model, path


def hf_features(model, images: torch.Tensor) -> torch.Tensor:
    from megamoe.vision.hf_qwen import images_to_pixel_values

    pv, grid = images_to_pixel_values(images, patch_size=4, merge_size=2)
    with torch.no_grad():
        return torch.cat(model.model.get_image_features(pv, grid).pooler_output)


def test_pixel_values_layout_matches_hf_processor_and_inverts_exactly():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from megamoe.vision.hf_qwen import images_to_pixel_values, pixel_values_to_images

    proc = Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2)
    images, pvs, grids = [], [], []
    for h, w in SIZES:
        img = torch.randn(1, 3, h, w, dtype=torch.float64)
        ref, gh, gw = proc.patchify(img, patch_size=4, merge_size=2, temporal_patch_size=2)
        pv, grid = images_to_pixel_values(img, patch_size=4, merge_size=2)
        assert torch.equal(pv, ref.reshape(-1, ref.size(-1))) and grid.tolist() == [[1, gh, gw]]
        images.append(img[0]), pvs.append(pv), grids.append(grid)
    back = pixel_values_to_images(torch.cat(pvs), torch.cat(grids), patch_size=4, merge_size=2)
    assert all(torch.equal(a, b) for a, b in zip(back, images))
    video = torch.cat(pvs)
    video[0, 3 * 16] += 1.0  # the second temporal frame of one patch differs: a video, not an image
    with pytest.raises(ValueError, match="temporal frames differ"):
        pixel_values_to_images(video, torch.cat(grids), patch_size=4, merge_size=2)
    with pytest.raises(ValueError, match="t=2: video"):
        pixel_values_to_images(torch.cat(pvs[:1] * 2), torch.tensor([[2, 8, 8]]), patch_size=4, merge_size=2)


def test_qwen_tower_from_hf_checkpoint_matches_hf_image_features(hf_model):
    from megamoe.vision.hf_qwen import qwen_vision_config
    from megamoe.vision.tower import VisionTower

    model, path = hf_model
    cfg = qwen_vision_config(model.config, weights=str(path))
    tower = VisionTower(cfg, out_dim=64).eval()
    assert cfg.encoder == "qwen3_vit_88m_enc" and cfg.image_token_id == IMAGE_TOKEN
    gen = torch.Generator().manual_seed(1)
    for h, w in SIZES:
        images = torch.randn(2, 3, h, w, generator=gen)
        ref = hf_features(model, images)
        with torch.no_grad():
            ours = tower(list(images))
        assert ours.shape == ref.shape == (2 * tower.num_tokens(h, w), 64)
        assert max_abs(ours, ref) <= 1e-5, (h, w, max_abs(ours, ref))
    # several sizes in one call keep image order
    mixed = [torch.randn(3, h, w, generator=gen) for h, w in SIZES]
    ref = torch.cat([hf_features(model, img[None]) for img in mixed])
    with torch.no_grad():
        assert max_abs(tower(mixed), ref) <= 1e-5


def test_hf_checkpoint_mismatch_is_one_line_error(hf_model):
    from megamoe.core.errors import CheckpointError
    from megamoe.vision.hf_qwen import qwen_vision_config
    from megamoe.vision.tower import VisionTower

    model, path = hf_model
    cfg = qwen_vision_config(model.config, weights=str(path))
    cfg.encoder_args["depth"] = 3  # the file has 2 blocks
    with pytest.raises(CheckpointError, match=r"lacks tensor blocks\.2\.") as err:
        VisionTower(cfg, out_dim=64)
    assert "\n" not in str(err.value)
    cfg = qwen_vision_config(model.config, weights=str(path), weights_prefix="nothing.")
    with pytest.raises(CheckpointError, match="no tensor name starts with weights_prefix='nothing.'"):
        VisionTower(cfg, out_dim=64)


def test_mrope_positions_match_hf_get_rope_index(hf_model):
    model, _ = hf_model
    s = 30
    ids = torch.randint(0, 90, (2, s), generator=torch.Generator().manual_seed(2))
    ids[0, 3:7] = IMAGE_TOKEN   # 16x16 image: 2x2 LM grid
    ids[0, 10:20] = IMAGE_TOKEN  # 16x40 image: 2x5 grid
    ids[1, 0:3] = IMAGE_TOKEN    # 24x8 image: 3x1 grid
    thw = torch.tensor([[1, 4, 4], [1, 4, 10], [1, 6, 2]])
    ref, ref_delta = model.model.get_rope_index(ids, (ids == IMAGE_TOKEN).int(), image_grid_thw=thw)
    spans = image_spans(ids, IMAGE_TOKEN, [4, 10, 3])
    pos, delta = mrope_positions(ids, spans, [(2, 2), (2, 5), (3, 1)])
    assert torch.equal(pos, ref) and torch.equal(delta, ref_delta.view(-1))


def test_fit_size_matches_hf_smart_resize():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    from megamoe.vision import fit_size

    rng = np.random.default_rng(0)
    for h, w in rng.integers(1, 3000, size=(200, 2)).tolist():
        if max(h, w) / min(h, w) > 200:
            continue
        assert fit_size(h, w, 32, 64 * 64, 512 * 512) == smart_resize(h, w, 32, 64 * 64, 512 * 512), (h, w)


def test_mrope_angles_match_hf_rotary():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    from megamoe.layers.rotary import mrope_cos_sin

    rot = Qwen3_5MoeTextRotaryEmbedding(hf_config().text_config)
    pos = torch.randint(0, 50, (3, 2, 9), generator=torch.Generator().manual_seed(3))
    ref_cos, ref_sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = mrope_cos_sin(pos, 8, 10000.0, [2, 1, 1])
    assert max_abs(cos, ref_cos) <= 1e-6 and max_abs(sin, ref_sin) <= 1e-6


def qwen3_5_lm_state(hf, layer_types, heads: int, kv_heads: int, d: int, gdn=None) -> dict:
    """megamoe names <- HF Qwen3.5 / Qwen3.5-MoE text weights (test-local; the converter owns the
    real table). q_proj rows are per head [q | gate]; megamoe fuses them per KV group as
    [q|gate of the group's heads, k_g, v_g]. GDN projections fuse into one in_proj; routed
    experts are already stacked [E, 2f, h] / [E, h, f] like megamoe's."""
    from megamoe.convert import hf_layout as L

    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    lm = "model.language_model."
    out = {"embedding.weight": sd[lm + "embed_tokens.weight"], "final_norm.weight": sd[lm + "norm.weight"],
           "output_layer.weight": sd["lm_head.weight"]}
    for i, kind in enumerate(layer_types):
        src, dst = f"{lm}layers.{i}.", f"layers.{i}."
        out[dst + "input_norm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_norm.weight"] = sd[src + "post_attention_layernorm.weight"]
        if kind == "full_attention":
            q = sd[src + "self_attn.q_proj.weight"].view(kv_heads, heads // kv_heads * 2 * d, -1)
            k, v = (sd[src + f"self_attn.{n}_proj.weight"].view(kv_heads, d, -1) for n in "kv")
            out[dst + "mixer.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.size(-1))
            for ours, theirs in (("q_norm", "q_norm"), ("k_norm", "k_norm"), ("linear_proj", "o_proj")):
                out[dst + f"mixer.{ours}.weight"] = sd[src + f"self_attn.{theirs}.weight"]
        else:
            a = src + "linear_attn."
            out[dst + "mixer.in_proj.weight"] = L.qwen3_5_to_in_proj(
                *(sd[a + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")), L.GDNShapes.from_config(gdn))
            out[dst + "mixer.conv_weight"] = L.conv_from_hf(sd[a + "conv1d.weight"])
            for name in ("A_log", "dt_bias", "norm.weight", "out_proj.weight"):
                out[dst + "mixer." + name] = sd[a + name]
        m = src + "mlp."
        if m + "gate_proj.weight" in sd:  # dense
            out[dst + "mlp.linear_fc1.weight"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
            out[dst + "mlp.linear_fc2.weight"] = sd[m + "down_proj.weight"]
        else:
            out.update({dst + "mlp.router.weight": sd[m + "gate.weight"],
                        dst + "mlp.experts.gate_up_weight": sd[m + "experts.gate_up_proj"],
                        dst + "mlp.experts.down_weight": sd[m + "experts.down_proj"],
                        dst + "mlp.shared_experts.linear_fc1.weight": torch.cat(
                            [sd[m + "shared_expert.gate_proj.weight"], sd[m + "shared_expert.up_proj.weight"]]),
                        dst + "mlp.shared_experts.linear_fc2.weight": sd[m + "shared_expert.down_proj.weight"],
                        dst + "mlp.shared_gate": sd[m + "shared_expert_gate.weight"]})
    return out


def perturbed_and_saved(hf, path):
    """Perturb the LM's (zero-initialised, (1 + w)) norms and routers so a missing or misplaced
    weight shows, then save the checkpoint the tower is read from."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "visual" not in name and (name.endswith("norm.weight") or name.endswith("mlp.gate.weight")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path)
    return hf


def prompt_with_images():
    """(input_ids [2, 32], images, pixel_values, image_grid_thw): three images, two in sample 0."""
    from megamoe.vision.hf_qwen import images_to_pixel_values

    gen = torch.Generator().manual_seed(4)
    images = [torch.randn(3, h, w, generator=gen) for h, w in ((16, 40), (24, 8), (32, 32))]
    ids = torch.randint(0, 90, (2, 32), generator=gen)
    ids[0, 2:12] = IMAGE_TOKEN   # 16x40: 2x5 tokens
    ids[0, 15:18] = IMAGE_TOKEN  # 24x8: 3x1
    ids[1, 5:21] = IMAGE_TOKEN   # 32x32: 4x4
    pv, thw = zip(*(images_to_pixel_values(img[None], patch_size=4, merge_size=2) for img in images))
    return ids, images, torch.cat(pv), torch.cat(thw)


def logits_error(hf, cfg, layer_types, gdn=None) -> float:
    from megamoe.model.multimodal import MultimodalModel

    ours = MultimodalModel(cfg).eval()
    state = qwen3_5_lm_state(hf, layer_types, 4, 2, 16, gdn)
    result = ours.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and all(k.startswith("vision.") for k in result.missing_keys)
    ids, images, pv, thw = prompt_with_images()
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=(ids == IMAGE_TOKEN).int()).logits
        got = ours(ids, images)
    assert want.abs().max() > 0.1
    return max_abs(got, want)


def megamoe_text_config(layout: str, vision, **sections):
    from megamoe.core.config import AttentionConfig, ModelConfig

    return ModelConfig(vocab_size=128, hidden_size=64, layout=layout, norm_zero_centered=True, vision=vision,
                       attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                                                 output_gate=True, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]),
                       **sections)


def test_multimodal_logits_match_hf_qwen3_5_moe(tmp_path):
    """The Qwen3.5-MoE stack (Gated DeltaNet x3 + gated attention, routed + shared experts) with
    images: megamoe's forward equals transformers' Qwen3_5MoeForConditionalGeneration."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    from megamoe.core.config import GDNConfig, MoEConfig
    from megamoe.vision.hf_qwen import qwen_vision_config

    torch.manual_seed(0)
    hf = perturbed_and_saved(Qwen3_5MoeForConditionalGeneration(hf_config()).eval(), tmp_path)
    gdn = GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)
    moe = MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=32, num_shared_experts=1,
                    shared_expert_ffn_hidden_size=32, shared_expert_gate=True)
    cfg = megamoe_text_config("GeGeGeAe", qwen_vision_config(hf.config, weights=str(tmp_path)), gdn=gdn, moe=moe)
    assert logits_error(hf, cfg, hf.config.text_config.layer_types, gdn) <= 1e-5


def test_multimodal_logits_match_hf_qwen3_5_dense(tmp_path):
    """Full forward with images (Qwen3.5 tower + merger, placeholder merge, interleaved M-RoPE,
    gated attention) against transformers' dense Qwen3_5ForConditionalGeneration."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from megamoe.core.config import MLPConfig
    from megamoe.vision.hf_qwen import qwen_vision_config

    text = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, layer_types=["full_attention"] * 2,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    vision = hf_config().vision_config.to_dict()
    torch.manual_seed(0)
    hf = perturbed_and_saved(Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=101,
        vision_start_token_id=102, vision_end_token_id=103)).eval(), tmp_path)
    cfg = megamoe_text_config("AdAd", qwen_vision_config(hf.config, weights=str(tmp_path)),
                              mlp=MLPConfig(ffn_hidden_size=96))
    assert logits_error(hf, cfg, ["full_attention"] * 2) <= 1e-5
