"""Importing FP8 checkpoints as they are released (megamoe.convert.quant): e4m3 weights with a
float32 ``weight_scale_inv`` per 128x128 block, padded edge blocks, ``quantization_config``.

Tiny deepseek_v3, deepseek_v32, minimax_m2 (and minimax, glm_moe_dsa, qwen3, qwen3_moe)
checkpoints are quantised as DeepSeek-V3.x and MiniMax-M2 ship theirs (tests/fp8_utils.py), imported, and compared with transformers' model
of the same FP8 checkpoint (fp32 logits, 1e-4). At the tiny widths (<= 128) every tensor is
one padded block, which transformers' CPU loader dequantises right; wider shapes with several
blocks and a padded edge are compared with transformers' FP8-linear dequantisation
(``_dequantize_fp8_weight``; its CPU loader derives the block from the scale grid instead,
which differs from the release's 128-blocks when a dimension is not a multiple of 128).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.convert import from_hf, import_hf
from megamoe.convert.quant import QuantFormat, dequantize, quantize_blocks
from megamoe.core.errors import CheckpointError
from tests.conversion_harness import ATOL, load_converted
from tests.fp8_utils import dequantized_like_transformers, quantize_block_by_block, quantize_like_release

IDS = torch.randint(3, 64, (2, 11), generator=torch.Generator().manual_seed(5))


def tiny(family: str):
    from tests.test_convert_deepseek import tiny_deepseek_v3, tiny_deepseek_v32
    from tests.test_convert_dense import tiny_qwen3
    from tests.test_convert_glm5_minimax_m import tiny_glm_moe_dsa, tiny_minimax_m2
    from tests.test_convert_glm_minimax import tiny_minimax
    from tests.test_convert_qwen import tiny_qwen3_moe

    return {"deepseek_v3": tiny_deepseek_v3, "deepseek_v32": tiny_deepseek_v32, "minimax": tiny_minimax,
            "minimax_m2": tiny_minimax_m2, "glm_moe_dsa": tiny_glm_moe_dsa, "qwen3": tiny_qwen3,
            "qwen3_moe": tiny_qwen3_moe}[family]()


def fp8_checkpoint(hf_model, root):
    hf_model.float().save_pretrained(root / "hf")
    quantised = quantize_like_release(root / "hf", root / "fp8")
    return root / "fp8", quantised


@pytest.fixture(scope="session")
def ds3_release(tmp_path_factory):
    """The tiny deepseek_v3 FP8 release (dir, {name: (e4m3, scale)}), built once for the FP8
    tests (tests/test_fp8_base.py imports it): they read it; a test that edits it copies it."""
    return fp8_checkpoint(tiny("deepseek_v3"), tmp_path_factory.mktemp("ds3_fp8"))


def test_quantizer_and_dequantizer_match_the_release_and_transformers():
    """megamoe's quantiser gives the release's bytes and scales (padded edges, stacked experts);
    its dequantisation is transformers' FP8-linear one bit for bit."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    gen = torch.Generator().manual_seed(0)
    for shape in ((200, 300), (128, 256), (5, 7)):
        w = torch.randn(shape, generator=gen) * torch.logspace(-2, 1, shape[1])
        q, s = quantize_blocks(w, (128, 128))
        want_q, want_s = quantize_block_by_block(w)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s), shape
        got = dequantize(q, s, QuantFormat((128, 128)), torch.float32)
        assert torch.equal(got, _dequantize_fp8_weight(q, s, [128, 128], torch.float32)), shape
        assert (got - w).abs().max() <= w.abs().max() * 2 ** -4
    stack = torch.randn(3, 140, 130, generator=gen)
    q, s = quantize_blocks(stack, (128, 128))
    assert s.shape == (3, 2, 2)
    for e in range(3):
        assert torch.equal(q[e].view(torch.uint8), quantize_block_by_block(stack[e])[0].view(torch.uint8))


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "minimax_m2", "minimax", "glm_moe_dsa", "qwen3",
                                    "qwen3_moe"])
@torch.no_grad()
def test_fp8_release_imports_with_transformers_logits(family, tmp_path):
    from transformers import AutoModelForCausalLM

    fp8_dir, quantised = fp8_checkpoint(tiny(family), tmp_path)
    assert quantised and (family == "qwen3" or any("experts" in n for n in quantised))
    want = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()(input_ids=IDS).logits
    model = load_converted(import_hf(fp8_dir, tmp_path / "mm", progress=False))
    assert (model(IDS) - want).abs().max() <= ATOL
    assert (from_hf(fp8_dir)(IDS) - want).abs().max() <= ATOL


@torch.no_grad()
def test_fp8_release_with_several_padded_blocks(tmp_path):
    """Widths of 136-200 (two blocks, the second padded) in every projection and expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from tests.test_convert_deepseek import randomized

    cfg = DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=160, intermediate_size=200,
                           moe_intermediate_size=136, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=140,
                           kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=36,
                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                           vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fp8_dir, quantised = fp8_checkpoint(randomized(DeepseekV3ForCausalLM(cfg)), tmp_path)
    assert any(s.shape[0] > 1 and q.shape[0] % 128 for q, s in quantised.values())
    want = dequantized_like_transformers(fp8_dir, tmp_path / "dequantised")(input_ids=IDS).logits
    model = load_converted(import_hf(fp8_dir, tmp_path / "mm", progress=False))
    assert (model(IDS) - want).abs().max() <= ATOL


@torch.no_grad()
def test_export_fp8_blocks_reads_back_in_transformers(ds3_release, tmp_path):
    """import (dequantised, fp32) -> export-hf --fp8-blocks 128: the release's tensors come back
    as e4m3 + weight_scale_inv with the release's quantization_config, the values equal the
    release's (each block requantised from its own dequantised values), transformers' logits
    equal megamoe's; without --fp8-blocks the export is plain (no quantization_config)."""
    from transformers import AutoModelForCausalLM
    from megamoe.convert import export_hf

    fp8_dir, quantised = ds3_release
    ckpt = import_hf(fp8_dir, tmp_path / "mm", progress=False)
    model = load_converted(ckpt)
    out = export_hf(ckpt, tmp_path / "back", fp8_blocks=128, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    back = {}
    for f in out.glob("*.safetensors"):
        back.update(load_file(f))
    assert {n for n, t in back.items() if t.dtype == torch.float8_e4m3fn} == set(quantised)
    fmt = QuantFormat((128, 128))
    for name, (q, s) in quantised.items():
        got = dequantize(back[name], back[name[:-6] + "weight_scale_inv"], fmt, torch.float32)
        assert torch.allclose(got, dequantize(q, s, fmt, torch.float32), rtol=1e-6, atol=0), name
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (hf(input_ids=IDS).logits - model(IDS)).abs().max() <= ATOL
    plain = export_hf(ckpt, tmp_path / "plain", progress=False)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    assert (AutoModelForCausalLM.from_pretrained(plain).eval()(input_ids=IDS).logits - model(IDS)).abs().max() <= ATOL


# ---- refusals: one line naming the tensor or field --------------------------------------------

def _edit(fp8_dir, config=None, tensors=None):
    if config:
        cfg = json.loads((fp8_dir / "config.json").read_text())
        config(cfg)
        (fp8_dir / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(fp8_dir / "model.safetensors")
        tensors(t)
        save_file(t, fp8_dir / "model.safetensors")


QC = "quantization_config"
SCALE = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"
REFUSALS = {
    "other method": (dict(config=lambda c: c[QC].update(quant_method="bitsandbytes")), ["quant_method", "bitsandbytes"]),
    "ue8m0 scales": (dict(config=lambda c: c[QC].update(scale_fmt="ue8m0")), ["scale_fmt", "ue8m0"]),
    "static activations": (dict(config=lambda c: c[QC].update(activation_scheme="static")), ["activation_scheme"]),
    "bad block": (dict(config=lambda c: c[QC].update(weight_block_size=[128])), ["weight_block_size"]),
    "no config": (dict(config=lambda c: c.pop(QC)), ["F8_E4M3", "quantization_config"]),
    "missing scale": (dict(tensors=lambda t: t.pop(SCALE)), ["experts.0.down_proj.weight", SCALE]),
    "scale shape": (dict(tensors=lambda t: t.update({SCALE: torch.ones(2, 1)})), [SCALE, "[2, 1]", "[1, 1]"]),
    "int scale": (dict(tensors=lambda t: t.update({SCALE: torch.ones(1, 1, dtype=torch.int32)})), [SCALE, "I32"]),
    "stray scale": (dict(tensors=lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)})),
                    ["model.norm.weight_scale_inv", "no FP8 tensor"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_fp8_refusals_are_one_line(case, ds3_release, tmp_path):
    import shutil

    edit, words = REFUSALS[case]
    fp8_dir = Path(shutil.copytree(ds3_release[0], tmp_path / "fp8"))
    _edit(fp8_dir, **edit)
    with pytest.raises(CheckpointError) as err:
        import_hf(fp8_dir, tmp_path / "out", progress=False)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert not (tmp_path / "out").exists()


def test_family_without_fp8_refuses_naming_the_tensor(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, vocab_size=64, num_local_experts=2)
                       ).save_pretrained(tmp_path / "hf")
    quantize_like_release(tmp_path / "hf", tmp_path / "fp8")
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.\S+ is F8_E4M3; mixtral does not convert FP8"):
        import_hf(tmp_path / "fp8", tmp_path / "out", progress=False)
