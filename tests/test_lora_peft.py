"""Adapters leave megamoe for transformers: ``export_peft`` on a model converted from HF, loaded with
``peft.PeftModel.from_pretrained`` on the converted-back HF model, gives the megamoe adapter
model's logits (fp32, max abs <= 1e-4), experts included; ``merge`` then ``to_hf`` writes a plain
HF model with the same logits; ``to_hf`` refuses unmerged adapters.

qwen3_next: fused QKV split into q/k/v_proj (A shared, B by part), Gated DeltaNet's fused in_proj
split into in_proj_qkvz / in_proj_ba (interleaved rows), a dense layer's and the shared expert's
gate|up split into gate_proj/up_proj (which PEFT would misread as routed experts in
target_modules), and one shared adapter for all routed experts, written per expert as PEFT's
stacked-expert ParamWrappers. (qwen3_moe with per-expert adapters: tests/test_lora_train.py.)
"""
from __future__ import annotations

import pytest
import torch

from megamoe.core.errors import CheckpointError
from tests.lora_utils import randomize_adapters

ATOL = 1e-4


def assert_peft_matches(ours, ids, tmp_path):
    """PEFT's adapter (``tmp_path/peft``) on the converted-back HF model (``tmp_path/back``) gives
    our adapter model's logits, which differ from the base model's (the adapters matter)."""
    from peft import PeftModel

    from megamoe.diagnostics.verify import load_hf_model

    hf = load_hf_model(tmp_path / "back")
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        theirs = PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()(input_ids=ids).logits
    assert (ours - base).abs().max() > 1e-2
    assert (ours - theirs).abs().max() <= ATOL


def test_peft_export_round_trip_qwen3_next(tmp_path):
    from megamoe.convert import from_hf, to_hf
    from megamoe.diagnostics.verify import load_hf_model
    from megamoe.convert import export_peft
    from megamoe.lora import LoRAConfig, apply_lora, lora_parameters, merge
    from tests.test_convert_qwen import tiny_qwen3_next

    tiny_qwen3_next().save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    to_hf(model, tmp_path / "back")  # the converted-back base model
    apply_lora(model, LoRAConfig(rank=4, alpha=8, expert_adapters="shared"))
    randomize_adapters(model, std=0.2)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        experts_off = {n: p.clone() for n, p in lora_parameters(model) if ".experts." in n}
        for n, p in lora_parameters(model):
            if n in experts_off:
                p.zero_()
        without_experts = model(ids)
        for n, p in lora_parameters(model):
            if n in experts_off:
                p.copy_(experts_off[n])
    assert (ours - without_experts).abs().max() > 1e-3  # the expert adapters matter here

    export_peft(model, tmp_path / "peft")
    with pytest.raises(CheckpointError, match="unmerged LoRA"):
        to_hf(model, tmp_path / "refused")
    assert_peft_matches(ours, ids, tmp_path)

    merge(model)
    to_hf(model, tmp_path / "merged")
    with torch.no_grad():
        merged = load_hf_model(tmp_path / "merged")(input_ids=ids).logits
    assert (ours - merged).abs().max() <= ATOL


def test_rslora_scale_and_peft_export(tmp_path):
    """rsLoRA: the adapters are scaled by alpha / sqrt(rank); the exported adapter says
    use_rslora and PEFT gives the same logits (per-expert adapters on qwen3_moe's experts)."""
    import json

    from megamoe.convert import from_hf, to_hf
    from megamoe.convert import export_peft
    from megamoe.lora import LoRAConfig, apply_lora
    from megamoe.lora.adapters import adapter_of, has_lora
    from tests.test_convert_qwen import tiny_qwen3_moe

    tiny_qwen3_moe().save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    to_hf(model, tmp_path / "back")
    apply_lora(model, LoRAConfig(rank=4, alpha=8, rslora=True))
    scales = {adapter_of(m).scale for m in model.modules() if has_lora(m)}
    assert scales == {8 / 4 ** 0.5}
    randomize_adapters(model, std=0.2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    export_peft(model, tmp_path / "peft")
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["use_rslora"] is True
    assert_peft_matches(ours, ids, tmp_path)
