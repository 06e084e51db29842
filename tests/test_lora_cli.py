"""A LoRA fine-tune's checkpoint through the commands: ``megamoe-convert export-hf --merge``
writes one HF model (base + adapters) that transformers loads with the logits of the adapted
megamoe model and of transformers' base + the PEFT export; ``export-peft`` names the base
model; ``megamoe-generate`` and ``megamoe-verify`` take the checkpoint directly."""
from __future__ import annotations

import json

import pytest
import torch

from megamoe.commands.cli import run_main
from megamoe.commands import convert, generate, verify
from tests.test_lora_train import tiny_converted_model


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(HF folder, imported base, run folder holding an adapter-only checkpoint, the adapted
    model unmerged). The checkpoint is written as the trainer writes it (Trainer.save: adapters
    only, meta with model, hf, lora and lora_base); the adapters are random, not zero."""
    from megamoe.inference.load import load_model
    from megamoe.lora import LoRAConfig, apply_lora, is_adapter_name, lora_parameters
    from megamoe.core.config_io import config_to_dict
    from megamoe.checkpoint.dcp import read_meta, save_checkpoint

    root = tmp_path_factory.mktemp("lora_cli")
    hf_dir, base = tiny_converted_model(root)
    meta = read_meta(base)
    lora = LoRAConfig(rank=4, alpha=8, targets=["*"])
    model = apply_lora(load_model(base), lora, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    extra = {"model": meta["model"], "hf": meta["hf"], "lora": config_to_dict(lora), "lora_base": str(base.resolve())}
    save_checkpoint(root / "run", 3, model.groups, [model], extra_meta=extra, select=is_adapter_name)
    return hf_dir, base, root / "run", model.eval()


IDS = torch.randint(0, 262, (2, 12), generator=torch.Generator().manual_seed(0))


def test_export_hf_merge_matches_the_adapted_model_and_peft(lora_run, tmp_path, capsys):
    from peft import PeftModel

    from megamoe.diagnostics.verify import load_hf_model

    hf_dir, base, run, model = lora_run
    run_main(convert.main, ["export-hf", str(run), str(tmp_path / "merged"), "--merge"])
    run_main(convert.main, ["export-peft", str(run / "step_00000003"), str(tmp_path / "peft")])
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir.resolve())
    with torch.no_grad():
        ours = model(IDS)
        merged = load_hf_model(tmp_path / "merged")(input_ids=IDS).logits
        hf_base = load_hf_model(hf_dir)
        base_logits = hf_base(input_ids=IDS).logits
        peft = PeftModel.from_pretrained(hf_base, str(tmp_path / "peft")).eval()(input_ids=IDS).logits
    assert (merged - ours).abs().max() <= 1e-4, (merged - ours).abs().max()
    assert (merged - peft).abs().max() <= 1e-4, (merged - peft).abs().max()
    assert (merged - base_logits).abs().max() > 1e-2  # the adapters change the model
    capsys.readouterr()


def test_generate_and_verify_take_a_lora_checkpoint(lora_run, capsys):
    from megamoe.inference.generate import generate as decode

    _, _, run, model = lora_run
    prompt = [3, 17, 42, 5]
    run_main(generate.main, [str(run), "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "6"])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == str(decode(model, torch.tensor([prompt]), 6)[0, len(prompt):].tolist())
    with pytest.raises(SystemExit) as e:
        run_main(verify.main, [str(run), "--tokens", "4"])
    assert e.value.code == 0 and capsys.readouterr().out.strip().endswith("OK")


def test_lora_checkpoint_without_its_base_is_one_line(lora_run, tmp_path, capsys):
    """A LoRA checkpoint whose recorded base is gone, or exported without --merge: one line
    naming the checkpoint and what to do, nothing written."""
    import shutil

    from tests.test_bad_inputs import assert_one_line, invoke

    _, _, run, _ = lora_run
    moved = tmp_path / "moved"
    shutil.copytree(run / "step_00000003", moved)
    meta = json.loads((moved / "meta.json").read_text())
    meta["lora_base"] = str(tmp_path / "deleted_base")
    (moved / "meta.json").write_text(json.dumps(meta))
    out = str(tmp_path / "out")
    assert_one_line(invoke(convert.main, ["export-hf", str(run), out], capsys), "LoRA checkpoint", "--merge")
    assert_one_line(invoke(convert.main, ["export-hf", str(moved), out, "--merge"], capsys), "deleted_base")
    assert_one_line(invoke(generate.main, [str(moved), "--ids", "1,2"], capsys), "lora_base", "deleted_base")
    assert_one_line(invoke(verify.main, [str(moved)], capsys), "deleted_base")
    assert_one_line(invoke(generate.main, [str(moved), "--ids", "1", "--base", out], capsys), "--base", "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved"]


def test_base_option_finds_a_moved_base(lora_run, tmp_path, capsys):
    """--base names the base weights when they are no longer where meta.json says."""
    import shutil

    from megamoe.inference.generate import generate as decode

    _, base, run, model = lora_run
    moved = tmp_path / "run"
    shutil.copytree(run, moved)
    for meta_file in moved.glob("step_*/meta.json"):
        meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "lora_base": "/gone"}))
    run_main(generate.main, [str(moved), "--ids", "3,17", "--max-new-tokens", "5", "--base", str(base)])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == str(decode(model, torch.tensor([[3, 17]]), 5)[0, 2:].tolist())
