"""Bad conversion input: each case is a one-line error naming the culprit, with nothing left
behind in the output location."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.convert import export_hf, import_hf
from megamoe.core.errors import CheckpointError, ConfigError, MegamoeError
from tests.test_convert_dense import tiny_qwen3


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "qwen3"
    tiny_qwen3().save_pretrained(d)
    return d


def copy(good: Path, tmp: Path) -> Path:
    d = tmp / "hf"
    shutil.copytree(good, d)
    return d


def edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def edit_weights(d: Path, fn) -> None:
    file = d / "model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def drop(name):
    return lambda t: t.pop(name)


def reshape(name):
    def fn(t):
        t[name] = torch.zeros(t[name].shape[0] + 1, *t[name].shape[1:])
    return fn


def add(name):
    def fn(t):
        t[name] = torch.zeros(3)
    return fn


def truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


CASES = {
    "missing config": (lambda d: (d / "config.json").unlink(), "config.json: not found"),
    "config not json": (lambda d: (d / "config.json").write_text("{oops"), "config.json: invalid JSON"),
    "unknown model_type": (lambda d: edit_config(d, model_type="gpt_neox_9000"),
                           "model_type='gpt_neox_9000' is not supported"),
    "missing config field": (lambda d: edit_config(d, num_attention_heads=None), "'num_attention_heads' is missing"),
    "truncated shard": (truncate, "model.safetensors: truncated"),
    "garbage shard": (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 7), "not a valid safetensors file"),
    "missing tensor": (lambda d: edit_weights(d, drop("model.layers.1.mlp.up_proj.weight")),
                       "tensor model.layers.1.mlp.up_proj.weight (for layers.1.mlp.linear_fc1.weight) is missing"),
    "wrong shape": (lambda d: edit_weights(d, reshape("model.layers.0.self_attn.o_proj.weight")),
                    "model.layers.0.self_attn.o_proj.weight gives layers.0.mixer.linear_proj.weight of shape"),
    "unmapped tensor": (lambda d: edit_weights(d, add("model.layers.0.mystery.weight")),
                        "tensor model.layers.0.mystery.weight is not mapped"),
    "config says more layers": (lambda d: edit_config(d, num_hidden_layers=3), "model.layers.2."),
    "config says fewer layers": (lambda d: edit_config(d, num_hidden_layers=1), "model.layers.1."),
    "config says other width": (lambda d: edit_config(d, intermediate_size=80), "model expects"),
    "tied but lm_head present": (lambda d: edit_config(d, tie_word_embeddings=True), "lm_head.weight is not mapped"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_hf_input(good, tmp_path, case):
    breaker, needle = CASES[case]
    d = copy(good, tmp_path)
    breaker(d)
    out = tmp_path / "out"
    with pytest.raises(MegamoeError) as e:
        import_hf(d, out, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


def test_bad_layout_for_import(good, tmp_path):
    with pytest.raises(ConfigError, match="num_heads=4 is invalid: must be divisible by parallel.tp=8"):
        import_hf(good, tmp_path / "out", tp=8, progress=False)
    assert not (tmp_path / "out").exists()


def test_existing_output_is_kept(good, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        import_hf(good, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"


def test_export_needs_a_megamoe_checkpoint(good, tmp_path):
    with pytest.raises(CheckpointError, match="meta.json missing"):
        export_hf(good, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_failure_midway_leaves_nothing(good, tmp_path, monkeypatch):
    """An error while tensors are being written removes the partial output."""
    from megamoe.convert import api

    calls = []
    real = api.HFCheckpoint.tensor

    def failing(self, name):
        calls.append(name)
        if len(calls) == 5:
            raise CheckpointError(f"simulated read failure at {name}")
        return real(self, name)

    monkeypatch.setattr(api.HFCheckpoint, "tensor", failing)
    with pytest.raises(CheckpointError, match="simulated"):
        import_hf(good, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
