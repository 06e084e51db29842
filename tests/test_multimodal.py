"""MultimodalModel: placeholder merge, image/placeholder mismatches, M-RoPE decoding, parameter
parts, training on generated shapes, and the vision tower's split mode over 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch

import megamoe.core.config as C
from megamoe.core.config import AttentionConfig, MLPConfig, ModelConfig, VisionConfig
from tests.numerics import max_abs, rel_err

IMG = 3  # image placeholder id
VIT = dict(encoder="vit_tiny_patch16_224", image_token_id=IMG,
           encoder_args=dict(embed_dim=32, depth=2, num_heads=2, patch_size=8, img_size=32))


def tiny_mm(layout: str = "AdAd", projector: str = "merger", mrope: bool = True, **kw) -> ModelConfig:
    vision = VisionConfig(**{**VIT, "projector": projector, **kw.pop("vision", {})})
    attn = AttentionConfig(num_heads=2, num_kv_heads=2, partial_rotary_factor=0.5,
                           mrope_section=[2, 1, 1] if mrope else None)
    return ModelConfig(vocab_size=60, hidden_size=32, layout=layout, attention=attn,
                       mlp=MLPConfig(ffn_hidden_size=64), vision=vision, **kw)


def build(cfg: ModelConfig, seed: int = 0, groups=None, **kw):
    from megamoe.model.multimodal import MultimodalModel
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.model.weights import initialize

    model = MultimodalModel(cfg, groups, **kw)
    initialize(model, groups or ParallelGroups(), seed)
    return model


def batch(seed: int = 0):
    """3 samples: two images (4 + 6 tokens), none, one image (4 tokens, at the start)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 60, (3, 24), generator=gen)
    ids[0, 2:6] = IMG
    ids[0, 8:14] = IMG
    ids[2, 0:4] = IMG
    images = [torch.randn(3, h, w, generator=gen) for h, w in ((32, 32), (48, 32), (32, 32))]
    return ids, images


def test_placeholders_are_replaced_by_projected_image_tokens():
    model = build(tiny_mm(projector="mlp"))
    ids = torch.randint(4, 60, (2, 40))
    ids[0, 1:17] = IMG  # 32x32 with the MLP projector: 16 tokens
    ids[1, 5:29] = IMG  # 48x32: 24 tokens
    images = [torch.randn(3, 32, 32), torch.randn(3, 48, 32)]
    hidden, pos, _ = model.embed_multimodal(ids, images)
    tokens = model.vision(images)
    emb = model.embed(ids)
    mask = ids == IMG
    assert torch.equal(hidden[mask], tokens) and torch.equal(hidden[~mask], emb[~mask])
    assert pos.shape == (3, 2, 40)


def test_image_placeholder_mismatches_are_one_line_errors():
    from megamoe.vision import ImageError

    model = build(tiny_mm())
    ids, images = batch()
    cases = [
        (ids, images[:2], r"beyond the 2 image\(s\) given \(14 placeholders, 10 image tokens\)"),
        (ids, images + [torch.randn(3, 32, 32)], r"4 image\(s\) given but input_ids hold placeholders .* for 3"),
        (ids.masked_fill(torch.arange(24) == 13, 7), images, r"image 1 needs 6 consecutive placeholders .* found 5"),
    ]
    straddle = ids.clone()
    straddle[0, 8:14] = 9
    straddle[0, 20:24] = IMG
    straddle[1, 0:2] = IMG  # image 1 (6 tokens) would run from sample 0 into sample 1
    cases.append((straddle, images, r"image 1 needs 6 consecutive placeholders \(id 3\) at input_ids\[0, 20\]"))
    for bad_ids, imgs, message in cases:
        with pytest.raises(ImageError, match=message) as err:
            model(bad_ids, imgs)
        assert "\n" not in str(err.value)
    with pytest.raises(ImageError, match=r"beyond the 0 image\(s\) given"):
        model.forward_stage(ids)  # a pipeline stage called without the batch's images


def test_several_images_per_sample_train_and_text_only_batches_keep_vision_grads():
    from megamoe.model.language_model import shift_labels

    model = build(tiny_mm())
    ids, images = batch()
    model(ids, images, labels=shift_labels(ids)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n.startswith("vision."))
    model.zero_grad(set_to_none=True)
    text = torch.randint(4, 60, (2, 10))
    model(text, labels=shift_labels(text)).backward()  # no images: vision grads are zeros, not None
    vision = [p.grad for n, p in model.named_parameters() if n.startswith("vision.")]
    assert all(g is not None and g.abs().sum() == 0 for g in vision)


def test_mrope_decode_with_cache_matches_full_forward():
    from megamoe.layers.cache.decode import InferenceCache

    model = build(tiny_mm()).eval()
    ids, images = batch()
    with torch.no_grad():
        full = model(ids, images)
        cache = InferenceCache(3)
        steps = [model(ids[:, :16], images, cache=cache)]
        for t in range(16, 24):  # text after the prompt continues at max position + 1
            steps.append(model(ids[:, t:t + 1], cache=cache))
    assert max_abs(torch.cat(steps, 1), full) <= 1e-5


def test_parameter_parts_freeze_and_learning_rates():
    from megamoe.model.multimodal import param_groups, parameter_part, set_trainable

    model = build(tiny_mm(vision=dict(lr_scale=0.1)))
    groups = {g["name"]: g for g in param_groups(model, lr=1e-3)}
    assert set(groups) == {"language", "vision_encoder", "vision_projector"}
    assert groups["vision_encoder"]["lr"] == pytest.approx(1e-4) and groups["language"]["lr"] == 1e-3
    counts = {k: len(g["params"]) for k, g in groups.items()}
    assert counts["vision_projector"] == 6 and sum(counts.values()) == len(list(model.parameters()))
    set_trainable(model, language=False, vision_encoder=False)
    assert [g["name"] for g in param_groups(model, lr=1e-3)] == ["vision_projector"]
    assert parameter_part("layers.0.mixer.linear_qkv.weight") == "language"
    torch.optim.AdamW(param_groups(model, lr=1e-3))  # the groups are what torch optimizers take


def test_meta_budget_counts_the_vision_tower():
    from megamoe.planning.plan import budget

    cfg = tiny_mm()
    model = build(cfg)
    parts = budget(cfg).parts
    assert parts["vision"][0] == sum(p.numel() for n, p in model.named_parameters() if n.startswith("vision."))
    assert sum(t for t, _ in parts.values()) == sum(p.numel() for p in model.parameters())


def lm_sections(layout_hybrid: str = "GeAe") -> tuple[str, dict]:
    """The hybrid (Gated DeltaNet + MoE) stack when both letters are registered, else dense."""
    import megamoe.layers  # noqa: F401
    from megamoe.layers.spec import MIXER_SPECS, MLP_SPECS

    if "G" in MIXER_SPECS and "e" in MLP_SPECS:
        return layout_hybrid, dict(gdn=C.GDNConfig(num_key_heads=2, num_value_heads=2, key_head_dim=8,
                                                   value_head_dim=8, chunk_size=16),
                                   moe=C.MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=32))
    return "AdAd", {}


def test_vit_plus_language_model_learns_shape_captions():
    """20 AdamW steps on generated image-caption pairs: the caption loss goes down."""
    from megamoe.data.shapes import WORDS, shape_pairs
    from megamoe.parallel.cross_entropy import IGNORE_INDEX

    layout, sections = lm_sections()
    cfg = tiny_mm(layout=layout, **sections)
    torch.manual_seed(0)
    model = build(cfg)
    prep = model.vision.preprocessor()
    vocab = {w: i + 4 for i, w in enumerate(WORDS)}  # 0 pad, 1 bos, 2 eos, 3 image
    pairs = shape_pairs(64, seed=0, sizes=[32, (32, 48)])

    def make(chunk):
        images, rows = [], []
        for img, caption in chunk:
            x = prep(img)
            images.append(x)
            rows.append([1] + [IMG] * model.vision.num_tokens(*x.shape[-2:])
                        + [vocab[w] for w in caption.split()] + [2])
        s = max(map(len, rows))
        ids = torch.zeros(len(rows), s, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row)
            labels[r, :len(row) - 1] = torch.tensor(row[1:])
        labels[(labels == IMG)] = IGNORE_INDEX  # no loss on predicting placeholders
        return ids, images, labels

    batches = [make(pairs[i:i + 8]) for i in range(0, 64, 8)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        ids, images, labels = batches[step % len(batches)]
        loss = model(ids, images, labels=labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.6 * first, (layout, losses)


# ---- split mode over 2 gloo ranks -------------------------------------------------------------

def split_case(sp: bool, num_images: int, seed: int = 0, vision_parallel: dict | None = None) -> dict:
    from megamoe.core.config import ParallelConfig
    from megamoe.model.language_model import shift_labels
    from megamoe.parallel.groups import build_groups
    from megamoe.model.weights import finalize_grads
    from tests.mixer_utils import param_grad_errors

    groups = build_groups(ParallelConfig(tp=2, sequence_parallel=sp))
    cfg = tiny_mm(vision=dict(parallel=C.VisionParallelConfig(**(vision_parallel or dict(mode="split")))))
    ref = build(tiny_mm(), seed)
    model = build(cfg, seed, groups, sequence_parallel=sp)
    ids, images = batch(seed)
    if num_images == 1:  # only the last image: one rank has nothing to encode
        ids[0, 2:6] = 9
        ids[0, 8:14] = 9
        images = images[2:]
    labels = shift_labels(ids)
    errs = {"logits": rel_err(model(ids, images), ref(ids, images))}
    loss, ref_loss = model(ids, images, labels=labels), ref(ids, images, labels=labels)
    errs["loss"] = rel_err(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    finalize_grads(model, groups)
    return param_grad_errors(ref, model, groups, errs)


@pytest.mark.parametrize("sp,num_images", [(False, 3), (True, 1)], ids=["tp2-3images", "tp2-sp-1image"])
def test_vision_split_over_tp_ranks_equals_single(pool, sp, num_images):
    results = pool(2).run(split_case, sp, num_images)
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: relative errors over 1e-5: {bad}"
    assert sum(k.startswith("grad vision.") for k in results[0]) > 20  # every vision gradient compared


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_vision_tensor_parallel_model_equals_single(pool, sp):
    """The encoder split over the LM's TP group (model.vision.parallel.tp=2) inside the whole
    multimodal model: logits, loss and every gradient equal the single-process model's."""
    results = pool(2).run(split_case, sp, 3, vision_parallel=dict(tp=2))
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: relative errors over 1e-5: {bad}"
    assert sum(k.startswith("grad vision.") for k in results[0]) > 20
