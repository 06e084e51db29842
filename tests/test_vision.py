"""megamoe.vision: bounded preprocessing and bad images, timm encoders of each output format,
local weights (safetensors / torch, strict), projectors, vision config errors."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from megamoe.core.config import ImageBoundsConfig, ModelConfig, VisionConfig
from megamoe.core.errors import CheckpointError, ConfigError
from megamoe.vision import ImageError, ImagePreprocessor, VisionTower
from megamoe.vision.projector import MLPProjector, PatchMerger

VIT = dict(encoder="vit_tiny_patch16_224", image_token_id=3,
           encoder_args=dict(embed_dim=32, depth=2, num_heads=2, patch_size=8, img_size=32))


def pre(**bounds) -> ImagePreprocessor:
    return ImagePreprocessor(ImageBoundsConfig(**bounds), patch_multiple=16, mean=(0.5,) * 3, std=(0.5,) * 3,
                             fixed_size=(32, 32), dynamic=True)


def pil(w: int, h: int, mode: str = "RGB", color=255):
    from PIL import Image

    return Image.new(mode, (w, h), color if mode != "RGB" else (color,) * 3)


def noise(w: int, h: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ---- preprocessing ---------------------------------------------------------------------------

def test_dynamic_resize_keeps_aspect_multiples_and_normalises():
    x = pre()(pil(100, 50))
    assert x.shape == (3, 48, 96) and torch.allclose(x, torch.ones_like(x))  # white -> (1 - .5) / .5
    small = pre(min_pixels=32 * 32)(pil(4, 4, color=0))
    assert small.shape == (3, 32, 32) and torch.allclose(small, -torch.ones_like(small))
    big = pre(max_pixels=128 * 128)(pil(2000, 1000))
    assert big.shape[1] % 16 == 0 and big.shape[2] % 16 == 0 and big.shape[1] * big.shape[2] <= 128 * 128
    assert pre(resize="fixed")(pil(100, 50)).shape == (3, 32, 32)  # squashed to the encoder size


def test_bad_images_are_one_line_errors(tmp_path):
    p = pre(max_input_pixels=300 * 300, max_aspect_ratio=20.0)
    cases = [
        (b"not an image", "unreadable"),
        (str(tmp_path / "missing.png"), "missing.png: unreadable"),
        (png_bytes(noise(64, 64))[:2000], "unreadable"),  # truncated: fails on decode
        (pil(8, 8, "CMYK", 0), "mode 'CMYK' is not allowed"),
        (pil(8, 8, "F", 0.5), "mode 'F' is not allowed"),
        (pil(400, 300), "over model.vision.bounds.max_input_pixels=90000"),
        (pil(420, 20), r"aspect ratio 21.0 \(420x20 px\) is over model.vision.bounds.max_aspect_ratio=20.0"),
        (np.zeros((8, 8, 3), np.float32), "arrays must be uint8"),
        (torch.zeros(3, 8, 8), "unsupported input type Tensor"),
    ]
    for source, message in cases:
        with pytest.raises(ImageError, match=message) as err:
            p(source)
        assert "\n" not in str(err.value)
    # the raw size bound is read from the header: a huge truncated file is rejected, not decoded
    with pytest.raises(ImageError, match="max_input_pixels"):
        p(png_bytes(noise(400, 300))[:2000])
    # an aspect ratio within bounds that cannot be resized into the pixel budget
    with pytest.raises(ImageError, match="cannot be resized into"):
        pre(max_pixels=64 * 64)(pil(3000, 20))


def test_allowed_modes_convert_to_rgb_and_arrays_work():
    p = pre()
    assert p(pil(32, 32, "L", 0)).shape == (3, 32, 32)
    assert p(pil(32, 32, "RGBA", (255, 0, 0, 0))).shape == (3, 32, 32)
    assert p(np.full((32, 48, 3), 255, np.uint8)).shape == (3, 32, 48)
    with pytest.raises(ImageError, match="mode 'L' is not allowed"):
        pre(modes=["RGB"])(pil(32, 32, "L", 0))


def test_bounds_config_errors():
    with pytest.raises(ConfigError, match=r"^model.vision.bounds.max_pixels=10 is invalid: must be >= min_pixels"):
        pre(max_pixels=10)
    with pytest.raises(ConfigError, match="patch_multiple=24 is invalid: must be a multiple of 16"):
        pre(patch_multiple=24)
    with pytest.raises(ConfigError, match="resize='dynamic' is invalid: the encoder takes only 224x224"):
        ImagePreprocessor(ImageBoundsConfig(resize="dynamic"), patch_multiple=16, mean=(0,) * 3, std=(1,) * 3,
                          fixed_size=(224, 224), dynamic=False)


# ---- encoders ------------------------------------------------------------------------------

def test_vit_features_drop_prefix_tokens_and_follow_image_size():
    tower = VisionTower(VisionConfig(**VIT, projector="mlp"), out_dim=16)
    img = torch.randn(2, 3, 48, 32)
    feats, grid = tower.encoder(img)
    full = tower.encoder.model.forward_features(img)
    assert grid == (6, 4) and feats.shape == (2, 24, 32) and torch.equal(feats, full[:, 1:])
    assert tower.preprocessor().mode == "dynamic" and tower.num_tokens(48, 32) == 24
    assert tower.image_tokens(pil(100, 50)) == (48 // 8) * (96 // 8)  # after the bounded resize


def test_convnet_nchw_features_are_row_major_patches():
    cfg = VisionConfig(encoder="convnext_atto", image_token_id=3, projector="merger",
                       encoder_args=dict(dims=(8, 8, 8, 16), depths=(1, 1, 1, 1)))
    tower = VisionTower(cfg, out_dim=16).eval()
    img = torch.randn(1, 3, 128, 64)
    feats, grid = tower.encoder(img)
    fmap = tower.encoder.model.forward_features(img)  # [1, 16, 4, 2]
    assert grid == (4, 2) and torch.equal(feats[0, 1 * 2 + 1], fmap[0, :, 1, 1])
    assert tower.patch_multiple == 64 and tower(list(img)).shape == (2, 16)


def test_encoder_errors_and_seeded_build():
    with pytest.raises(ConfigError, match="model.vision.encoder='no_such_net' is not a timm model"):
        VisionTower(VisionConfig(encoder="no_such_net", image_token_id=3), out_dim=8)
    with pytest.raises(ConfigError, match="model.vision.encoder_args=.* rejected by vit_tiny_patch16_224"):
        VisionTower(VisionConfig(**{**VIT, "encoder_args": dict(depth=1, no_such_arg=1)}), out_dim=8)
    a, b = (VisionTower(VisionConfig(**VIT), out_dim=8) for _ in range(2))
    c = VisionTower(VisionConfig(**VIT, seed=1), out_dim=8)
    wa, wb, wc = (t.encoder.model.blocks[0].attn.qkv.weight for t in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)  # every rank builds the same encoder


def test_freeze_keeps_encoder_out_of_autograd():
    tower = VisionTower(VisionConfig(**VIT, projector="merger", freeze=True), out_dim=16).train()
    assert not tower.encoder.training and tower.projector.training
    tower([torch.randn(3, 32, 32)]).sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in tower.encoder.parameters())
    assert all(p.grad is not None for p in tower.projector.parameters())


def test_local_weights_safetensors_torch_and_strict_errors(tmp_path):
    from safetensors.torch import save_file

    src = VisionTower(VisionConfig(**VIT, seed=5), out_dim=8)
    state = {k: v.contiguous() for k, v in src.encoder.model.state_dict().items()}
    save_file(state, str(tmp_path / "enc.safetensors"))
    torch.save({"state_dict": state}, tmp_path / "enc.pt")
    for path in (tmp_path / "enc.safetensors", tmp_path / "enc.pt", tmp_path):
        loaded = VisionTower(VisionConfig(**VIT, weights=str(path)), out_dim=8)
        assert all(torch.equal(loaded.encoder.model.state_dict()[k], v) for k, v in state.items()), path
    bad = [
        (dict(weights=str(tmp_path / "nope.safetensors")), "no such file or directory"),
        (dict(weights=str(tmp_path / "enc.safetensors"), encoder_args={**VIT["encoder_args"], "depth": 3}),
         r"lacks tensor blocks\.2\."),
        (dict(weights=str(tmp_path / "enc.safetensors"), weights_filter="none",
              encoder_args={**VIT["encoder_args"], "embed_dim": 64}), r"has shape \[.*\], the encoder expects"),
        (dict(weights=str(tmp_path / "enc.safetensors"), weights_filter="no.such.fn"), "weights_filter='no.such.fn'"),
    ]
    for kw, message in bad:
        with pytest.raises((CheckpointError, ConfigError), match=message) as err:
            VisionTower(VisionConfig(**{**VIT, **kw}), out_dim=8)
        assert "\n" not in str(err.value)
    save_file({**state, "text.extra": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="tensor text.extra matches nothing"):
        VisionTower(VisionConfig(**VIT, weights=str(tmp_path / "extra.safetensors")), out_dim=8)
    (tmp_path / "broken.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="broken.safetensors: cannot read tensors"):
        VisionTower(VisionConfig(**VIT, weights=str(tmp_path / "broken.safetensors")), out_dim=8)


# ---- projectors ----------------------------------------------------------------------------

def test_patch_merger_matches_timm_qwen_merger_and_block_order():
    from timm.models.qwen3_vit import Qwen3VitPatchMerger

    torch.manual_seed(0)
    ours, theirs = PatchMerger(6, 10, merge_size=2), Qwen3VitPatchMerger(6, merge_size=2, out_features=10)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 4 * 6, 6)
    out, grid = ours(x, (4, 6))
    assert grid == (2, 3) and torch.allclose(out, theirs(x.view(2, 4, 6, 6)), atol=1e-6)
    merged, _ = ours.merge(x, (4, 6))  # token (1, 2) = patches (2,4) (2,5) (3,4) (3,5), row-major
    want = torch.cat([x[:, r * 6 + c] for r, c in ((2, 4), (2, 5), (3, 4), (3, 5))], -1)
    assert torch.equal(merged[:, 1 * 3 + 2], want)
    with pytest.raises(ValueError, match="patch grid 3x6 is not divisible by merge_size=2"):
        ours(torch.randn(1, 18, 6), (3, 6))


def test_projector_parameter_counts():
    d, hid, out, k = 6, 12, 10, 2
    assert sum(p.numel() for p in MLPProjector(d, out, hid).parameters()) == d * hid + hid + hid * out + out
    m = k * k * d
    assert sum(p.numel() for p in PatchMerger(d, out, k).parameters()) == 2 * d + m * m + m + m * out + out


def test_vision_config_errors_are_one_line():
    base = dict(vocab_size=50, hidden_size=32, layout="Ad")
    cases = [
        (dict(image_token_id=-1), r"^model.vision.image_token_id=-1 is invalid: set the id"),
        (dict(image_token_id=50), r"^model.vision.image_token_id=50 is invalid: must be < vocab_size=50"),
        (dict(image_token_id=3, projector="qformer"), r"^model.vision.projector='qformer' is invalid: allowed"),
        (dict(image_token_id=3, parallel=dict(tp=0)), r"^model.vision.parallel.tp=0 is invalid: must be a positive"),
        (dict(image_token_id=3, parallel=dict(tp=2, mode="split")),
         r"^model.vision.parallel.mode='split' is invalid: must be replicated with tp=2"),
        (dict(image_token_id=3, parallel=dict(mode="sharded")), r"^model.vision.parallel.mode='sharded'"),
    ]
    from megamoe.core.config import VisionParallelConfig

    for vision, message in cases:
        if "parallel" in vision:
            vision = {**vision, "parallel": VisionParallelConfig(**vision["parallel"])}
        with pytest.raises(ConfigError, match=message) as err:
            ModelConfig(**base, vision=VisionConfig(**vision)).validate()
        assert "\n" not in str(err.value)
