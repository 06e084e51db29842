"""megamoe's own timm-style towers and the pieces they share (megamoe.vision.pos_embed) against
transformers: 2D rotary layouts, learned-grid resampling, Kimi-K2.5's MoonViT image features."""
from __future__ import annotations

import pytest
import torch

from tests.numerics import max_abs


def hf_rope(rotary_cls, head_dim: int, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [h*w, head_dim] of a transformers 2D vision rotary module on a raster grid."""
    from types import SimpleNamespace

    from transformers.vision_utils import get_vision_position_ids

    cfg = SimpleNamespace(rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}, head_dim=head_dim,
                          hidden_size=head_dim, num_attention_heads=1)
    pos = get_vision_position_ids(torch.tensor([[1, *size]]), spatial_merge_size=1)
    return rotary_cls(cfg)(torch.zeros(1), pos)


@pytest.mark.parametrize("layout", ["hw", "wh_interleaved"])
def test_axial_rope_layouts_match_transformers(layout):
    """'hw' is GLM-5's (and Qwen-VL's) vision rotary, 'wh_interleaved' Kimi-K2.5's, bit for bit."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionRotaryEmbedding
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionRotaryEmbedding

    from megamoe.vision.pos_embed import axial_rope

    cls = Glm5NextVisionRotaryEmbedding if layout == "hw" else Kimi_K25VisionRotaryEmbedding
    for size in ((3, 5), (4, 4)):
        cos, sin = hf_rope(cls, 16, size)
        ours = axial_rope(size, 16, 10000.0, layout)
        assert torch.equal(ours, torch.cat([sin, cos], dim=-1)), (layout, size)


@pytest.mark.parametrize("mode,align", [("bicubic", False), ("bilinear", True)])
def test_resample_grid_matches_transformers_taps(mode, align):
    """Kimi's bicubic (align_corners=False) and Qwen's bilinear (True) resampling of a learned grid
    equal transformers' gather of interpolation taps (fp64 tables; transformers works its tap weights
    out in fp32, which bounds the agreement to a few 1e-6), and
    the grid's own size returns the table itself."""
    import torch.nn.functional as F
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    from megamoe.vision.pos_embed import resample_grid

    table = torch.randn(6, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for size in ((4, 10), (9, 9), (2, 7)):
        idx, w = get_vision_interpolation_indices_and_weights(torch.tensor([[1, *size]]), 6, mode=mode,
                                                              align_corners=align)
        want = F.embedding_bag(idx, table.flatten(0, 1), per_sample_weights=w.double(), mode="sum")
        assert max_abs(resample_grid(table, size, mode, align), want) <= 5e-6, size
    assert torch.equal(resample_grid(table, (6, 6)), table.reshape(36, 8))


def test_kimi_tower_matches_transformers_image_features():
    """MoonViT + merger loaded from a tiny random Kimi-K2.5 reproduce get_image_features: exactly at
    the native position grid, to fp32 rounding where the grid is resampled."""
    from megamoe.convert import api
    from megamoe.vision.hf_kimi import images_to_pixel_values, kimi_vision_config, pixel_values_to_images
    from megamoe.vision.tower import VisionTower
    from tests.test_convert_kimi_k25 import PATCH, tiny_kimi_k25

    hf = tiny_kimi_k25()
    tower = VisionTower(kimi_vision_config(hf.config), out_dim=32).eval()
    family = api.get_family("kimi_k25")
    theirs = dict(hf.state_dict())
    entries = api.plan_entries(family, family.config_from_hf(hf.config.to_dict()), hf.config.to_dict(), set(theirs))
    state = {e.mm.removeprefix("vision."): e.to_mm([theirs[n] for n in e.hf]) for e in entries
             if e.mm.startswith("vision.")}
    tower.load_state_dict(state, strict=True)
    gen = torch.Generator().manual_seed(1)
    for h, w in ((24, 24), (16, 40), (32, 8)):
        img = torch.randn(1, 3, h, w, generator=gen)
        pv, grid = images_to_pixel_values(img, PATCH)
        assert torch.equal(pixel_values_to_images(pv, grid)[0], img[0])
        with torch.no_grad():
            want = torch.cat(hf.model.get_image_features(pv, grid).pooler_output)
            got = tower([img[0]])
        assert max_abs(got, want) <= (0.0 if (h, w) == (24, 24) else 1e-5 * want.abs().max()), (h, w)


def test_glm5_tower_matches_transformers_image_features():
    """glm5_vit_enc + glm_merger loaded through the glm5_next table reproduce get_image_features of a
    tiny random GLM-5 (RMSNorms, q/k norms, clamped SwiGLUs at active clamps, conv downsample)."""
    from megamoe.convert import api
    from megamoe.vision.hf_glm import glm_vision_config
    from megamoe.vision.hf_qwen import images_to_pixel_values
    from megamoe.vision.tower import VisionTower
    from tests.test_convert_glm_minimax import tiny_glm5_next

    hf = tiny_glm5_next().float().eval()
    cfg = hf.config.to_dict()
    tower = VisionTower(glm_vision_config(cfg), out_dim=32).eval()
    family = api.get_family("glm5_next")
    theirs = dict(hf.state_dict())
    entries = api.plan_entries(family, family.config_from_hf(cfg), cfg, set(theirs))
    tower.load_state_dict({e.mm.removeprefix("vision."): e.to_mm([theirs[n] for n in e.hf]) for e in entries
                           if e.mm.startswith("vision.")}, strict=True)
    gen = torch.Generator().manual_seed(2)
    for h, w in ((16, 16), (8, 40), (24, 8)):
        img = torch.randn(1, 3, h, w, generator=gen)
        pv, grid = images_to_pixel_values(img, patch_size=4, merge_size=2)
        with torch.no_grad():
            want = hf.model.get_image_features(pv, grid).pooler_output[0]
            got = tower([img[0]])
        assert max_abs(got, want) <= 1e-5 * want.abs().max(), (h, w)
