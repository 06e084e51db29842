"""Tensor parallelism inside the vision encoder (``model.vision.parallel.tp=2``, the LM's TP
group) against the single-process tower: image tokens and every parameter gradient
(gathered, q/k-norm partial sums reduced), fp32, relative error <= 1e-5, for timm's
Attention + Mlp (ViT with q/k norm), GluMlp and SwiGLU MLPs, AttentionRope (Qwen3 ViT) and
megamoe's timm-style towers (Kimi-K2.5's MoonViT, GLM-5's ViT with clamped SwiGLUs)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megamoe.core.config import VisionConfig, VisionParallelConfig
from tests.numerics import rel_err

VIT_ARGS = dict(embed_dim=32, depth=2, num_heads=4, patch_size=8, img_size=32, qk_norm=True)
ENCODERS = {
    "vit-qknorm": dict(encoder="vit_tiny_patch16_224", encoder_args=VIT_ARGS),
    "vit-glu": dict(encoder="vit_tiny_patch16_224", encoder_args={**VIT_ARGS, "mlp_layer": "glu"}),
    "vit-swiglu": dict(encoder="vit_tiny_patch16_224", encoder_args={**VIT_ARGS, "mlp_layer": "swiglu"}),
    "qwen3_vit": dict(encoder="qwen3_vit_88m_enc",
                      encoder_args=dict(embed_dim=32, depth=2, num_heads=4, patch_size=8, img_size=32,
                                        out_features=16)),
    "kimi_k25_vit": dict(encoder="kimi_k25_vit_enc",
                         encoder_args=dict(embed_dim=32, depth=2, num_heads=4, mlp_hidden_dim=48, patch_size=8,
                                           pos_embed_grid=(4, 4), img_size=32)),
    "glm5_vit": dict(encoder="glm5_vit_enc", encoder_args=dict(embed_dim=32, depth=2, num_heads=4, mlp_hidden_dim=48,
                                                               patch_size=8, img_size=32, swiglu_limit=0.5)),
}


def vision_config(name: str, tp: int) -> VisionConfig:
    args = dict(ENCODERS[name])
    encoder_args = dict(args.pop("encoder_args"))
    if encoder_args.get("mlp_layer") == "glu":
        from timm.layers import SwiGLUPacked
        encoder_args["mlp_layer"] = SwiGLUPacked
    elif encoder_args.get("mlp_layer") == "swiglu":
        from timm.layers import SwiGLU
        encoder_args["mlp_layer"] = SwiGLU
    return VisionConfig(**args, encoder_args=encoder_args, image_token_id=3, projector="merger",
                        parallel=VisionParallelConfig(tp=tp))


def tower_case(names: list[str]) -> dict:
    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.groups import ParallelGroups, build_groups
    from megamoe.parallel.sharding import gather_full
    from megamoe.vision import VisionTower
    from megamoe.model.weights import finalize_grads, initialize

    groups = build_groups(ParallelConfig(tp=2))
    errs = {}
    for name in names:
        ref = VisionTower(vision_config(name, 1), out_dim=16)
        tower = VisionTower(vision_config(name, 2), out_dim=16, tp_group=groups.tp)
        initialize(ref, ParallelGroups(), seed=1)  # the projector; the encoder keeps timm's init
        initialize(tower, groups, seed=1)          # (gathered from the tensor-parallel pieces)
        gen = torch.Generator().manual_seed(0)
        images = [torch.randn(3, h, w, generator=gen) for h, w in ((32, 32), (48, 32), (32, 32))]
        out, want = tower(images), ref(images)
        errs[f"{name} tokens"] = rel_err(out, want)
        weight = torch.randn(want.shape, generator=gen)
        (out * weight).sum().backward()
        (want * weight).sum().backward()
        finalize_grads(tower, groups)
        ref_params = dict(ref.named_parameters())
        split = 0
        for pname, p in tower.named_parameters():
            got, ref_grad = gather_full(p, groups, p.grad), ref_params[pname].grad
            if pname.endswith("k_norm.bias"):
                # adding a vector to every key of a head shifts each softmax row by a constant: the
                # exact gradient is zero and both sides hold rounding noise, so compare it absolutely
                errs[f"{name} grad {pname} (exactly 0)"] = max(got.abs().max().item(), ref_grad.abs().max().item())
            else:
                errs[f"{name} grad {pname}"] = rel_err(got, ref_grad)
            split += tuple(p.shape) != tuple(ref_params[pname].shape)
        errs[f"{name} split tensors"] = 0.0 if split >= 8 else float("inf")  # 2 blocks x (qkv, proj, fc1, fc2)
    return errs


def test_encoder_tp2_equals_single(pool):
    results = pool(2).run(tower_case, list(ENCODERS))
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: relative errors over 1e-5: {bad}"
    assert sum("grad" in k for k in results[0]) > 40


def test_encoder_tp_config_errors():
    from megamoe.core.config import ParallelConfig
    from megamoe.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.vision.parallel.mode='split' is invalid: must be replicated"):
        VisionConfig(**ENCODERS["vit-qknorm"], image_token_id=3,
                     parallel=VisionParallelConfig(tp=2, mode="split")).validate(32)
    with pytest.raises(ConfigError, match=r"^model.vision.parallel.tp=2 is invalid: must be 1 or the language "
                                          r"model's parallel.tp=4"):
        vision_config("vit-qknorm", 2).validate_parallel(ParallelConfig(tp=4))


# ---- a converted checkpoint (tower stored whole) loaded into an encoder split over TP ------------

def converted_case(root: str, ids: torch.Tensor, images: list, want: torch.Tensor) -> dict:
    """Load the tp=2 import of an HF Qwen3.5-MoE into a model whose encoder is split too, compare
    logits with transformers', and export it back (rank 0's directory is read by the test)."""
    import dataclasses

    import torch.distributed as dist

    from megamoe.core.config import ParallelConfig
    from megamoe.convert import build_model, to_hf
    from megamoe.parallel.groups import build_groups
    from megamoe.core.config_io import config_from_dict
    from megamoe.checkpoint.dcp import load_checkpoint, read_meta
    from tests.numerics import max_abs

    meta = read_meta(Path(root) / "tp2")
    cfg = config_from_dict(meta["model"])
    cfg = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, parallel=VisionParallelConfig(tp=2)))
    groups = build_groups(ParallelConfig(tp=2))
    model = build_model(cfg, groups).eval()
    assert model.vision.encoder.model.blocks[0].attn.num_heads == 1  # 2 heads, one per rank
    load_checkpoint(Path(root) / "tp2", groups, [model], load_rng=False)
    with torch.no_grad():
        err = max_abs(model(ids, images), want)
    to_hf(model, Path(root) / f"back_rank{dist.get_rank()}", family=meta["hf"]["model_type"],
          hf_config=meta["hf"]["config"], groups=groups)
    return {"logits": err}


@torch.no_grad()
def test_converted_tower_loads_into_a_split_encoder_and_exports(pool, tmp_path):
    from megamoe.convert import import_hf
    from megamoe.diagnostics.verify import load_hf_model
    from tests.conversion_harness import ATOL
    from tests.numerics import max_abs
    from tests.test_convert_qwen import image_inputs, tiny_qwen3_5_moe

    hf = tiny_qwen3_5_moe()
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "tp2", tp=2, progress=False)
    ids, images, hf_inputs = image_inputs(hf.config.image_token_id)
    want = hf(**hf_inputs).logits
    for rank, errs in enumerate(pool(2).run(converted_case, str(tmp_path), ids, images, want)):
        assert errs["logits"] <= ATOL, (rank, errs)
    exported = load_hf_model(tmp_path / "back_rank0")
    assert max_abs(exported(**hf_inputs).logits, want) <= ATOL


def training_checkpoint_case(root: str) -> dict:
    """A training checkpoint saved with the tower replicated (vision tp=1) at TP=2 resumes into
    a model whose encoder is split (vision tp=2): the same logits."""
    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.groups import build_groups
    from megamoe.checkpoint.dcp import load_checkpoint, save_checkpoint
    from tests.test_multimodal import batch, build, tiny_mm

    groups = build_groups(ParallelConfig(tp=2))
    ids, images = batch(0)
    whole = build(tiny_mm(), 3, groups).eval()
    path = save_checkpoint(root, 1, groups, [whole])
    split = build(tiny_mm(vision=dict(parallel=VisionParallelConfig(tp=2))), 4, groups).eval()
    load_checkpoint(path, groups, [split], load_rng=False)
    save_checkpoint(Path(root) / "split", 1, groups, [split])
    with torch.no_grad():
        logits = split(ids, images)
        return {"logits": rel_err(logits, whole(ids, images)), "split logits": logits}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note on a one-process read
def test_training_checkpoint_of_a_replicated_tower_resumes_split(pool, tmp_path):
    """... and the split tower's checkpoint reads back in one process (what export-hf does):
    the encoder keeps its split rules with a group of one and reassembles the pieces."""
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.checkpoint.dcp import load_checkpoint
    from tests.test_multimodal import batch, build, tiny_mm

    results = pool(2).run(training_checkpoint_case, str(tmp_path))
    for rank, errs in enumerate(results):
        assert errs["logits"] <= 1e-6, (rank, errs)
    one = build(tiny_mm(vision=dict(parallel=VisionParallelConfig(tp=2))), 5).eval()
    load_checkpoint(tmp_path / "split" / "step_00000001", ParallelGroups(), [one], load_rng=False)
    ids, images = batch(0)
    with torch.no_grad():
        assert rel_err(one(ids, images), results[0]["split logits"]) <= 1e-6


def test_lora_targets_do_not_depend_on_the_encoder_split():
    """With the encoder's linears made parallel (vision tp=2), LoRA's default targets ("*")
    still select the language model's modules only, as with a replicated tower."""
    from megamoe.lora import LoRAConfig, apply_lora
    from tests.test_multimodal import build, tiny_mm

    chosen = []
    for tp in (1, 2):
        model = apply_lora(build(tiny_mm(vision=dict(parallel=VisionParallelConfig(tp=tp))), 0), LoRAConfig(rank=2))
        chosen.append(sorted(n for n, _ in model.named_parameters() if "lora_" in n))
    assert chosen[0] == chosen[1] and chosen[0] and not any(n.startswith("vision.") for n in chosen[0])
