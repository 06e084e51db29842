"""Tiered experts read straight from the HF checkpoint a model was imported from
(``model.moe.expert_store.path = HF_DIR``): LoRA fine-tunes give the loss curve of the resident
model imported from the same directory (fp32, <= 1e-6), for Qwen3-MoE and Mixtral, each in
transformers' per-expert and stacked expert layouts (different tensor names: gate/up/down
against w1/w3/w2 under block_sparse_moe), at EP=2 too; a missing or corrupt shard is one line
naming the file."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megamoe.core.errors import CheckpointError
from tests.test_expert_store import finetune

STEPS = 3


def hf_dir(family: str, layout: str, root: Path, shard: str | None = None, dtype=torch.float32) -> Path:
    """A tiny random HF model of ``family`` saved in ``layout`` (per_expert | stacked), in ``dtype``."""
    from tests.test_convert_mixtral import tiny_mixtral
    from tests.test_convert_qwen import tiny_qwen3_moe

    model = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral}[family]().to(dtype)
    out = root / f"{family}_{layout}_{str(dtype)[6:]}"
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, save_original_format=layout == "per_expert", **kw)
    return out


def imported(hf: Path, root: Path) -> str:
    from megamoe.convert import import_hf

    return str(import_hf(hf, root / f"{hf.name}_megamoe", progress=False))


@pytest.mark.parametrize("family,layout,dtype", [("qwen3_moe", "per_expert", torch.float32),
                                                  ("qwen3_moe", "stacked", torch.float32),
                                                  ("mixtral", "per_expert", torch.float32),
                                                  ("mixtral", "stacked", torch.float32),
                                                  ("qwen3_moe", "per_expert", torch.bfloat16)])
def test_lora_with_experts_read_from_the_hf_checkpoint_matches_resident(tmp_path, family, layout, dtype):
    """bf16: a bf16 model (params_dtype follows the HF config) fine-tuned on bf16 files."""
    hf = hf_dir(family, layout, tmp_path, dtype=dtype)
    names = set()
    for f in hf.glob("*.safetensors"):
        from safetensors import safe_open
        with safe_open(f, "pt") as st:
            names |= set(st.keys())
    assert any((".experts.0." in n) == (layout == "per_expert") for n in names if "experts" in n), sorted(names)
    ckpt = imported(hf, tmp_path)
    resident = finetune(ckpt, str(tmp_path / "resident"), None, steps=STEPS)
    tiered = finetune(ckpt, str(tmp_path / "tiered"), 0.006, steps=STEPS, store_path=str(hf))
    diff = max(abs(a - b) for a, b in zip(resident["losses"], tiered["losses"]))
    assert len(tiered["losses"]) == STEPS and diff <= 1e-6, (resident["losses"], tiered["losses"])
    assert tiered["stats"]["misses"] > 0 and tiered["stats"]["read_bytes"] > 0, tiered["stats"]
    # stacked fp32 experts are viewed in the mapped files; one tensor per weight, or bf16 files, copied
    assert tiered["stats"]["mapped"] == (layout == "stacked" and dtype == torch.float32), tiered["stats"]


def ep_run(ckpt: str, log_dir: str, hf: str) -> tuple[list[float], list[int]]:
    """The rank's losses and the (global) experts its store read from the HF files."""
    from megamoe.expert_store.hf import PerExpertTensors

    read, seen = PerExpertTensors.read, set()

    def recording(self, expert, w1, w2):
        seen.add(expert)
        return read(self, expert, w1, w2)

    PerExpertTensors.read = recording
    try:
        return finetune(ckpt, log_dir, 0.006, {"ep": 2}, steps=STEPS, store_path=hf)["losses"], sorted(seen)
    finally:
        PerExpertTensors.read = read


def test_hf_expert_store_at_ep2_matches_one_process(pool, tmp_path):
    """Each EP rank reads only its own experts (4 experts: 0-1 on one rank, 2-3 on the other)."""
    hf = hf_dir("qwen3_moe", "per_expert", tmp_path)
    ckpt = imported(hf, tmp_path)
    one = finetune(ckpt, str(tmp_path / "one"), None, steps=STEPS)["losses"]
    runs = pool(2).run(ep_run, ckpt, str(tmp_path / "ep2"), str(hf))
    for losses, _ in runs:
        assert max(abs(a - b) for a, b in zip(one, losses)) <= 1e-6, (one, losses)
    halves = sorted(tuple(sorted({e // 2 for e in read})) for _, read in runs)
    assert halves == [(0,), (1,)], [read for _, read in runs]


def _open(hf: Path, ckpt: str):
    from megamoe.core.config import ExpertStoreConfig
    from megamoe.model.language_model import LanguageModel
    from megamoe.core.config_io import config_from_dict
    from megamoe.expert_store import open_expert_store
    from megamoe.checkpoint.dcp import read_meta

    cfg = config_from_dict(read_meta(ckpt)["model"])
    cfg.moe.expert_store = ExpertStoreConfig(budget_mib=0.006, path=str(hf))
    model = LanguageModel(cfg)
    return open_expert_store([model], model.groups)


def test_bf16_files_into_an_fp32_model_and_etp_slices(tmp_path):
    """A stack read from bf16 per-expert files for an fp32 model is the files' gate|up rows and
    down weight in fp32; under ETP=2 each slice is its f-half of gate, of up, and of down's columns."""
    from safetensors import safe_open

    from megamoe.expert_store.hf import hf_expert_sources

    hf = hf_dir("qwen3_moe", "per_expert", tmp_path, dtype=torch.bfloat16)
    tensors = {}
    for f in hf.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            tensors |= {k: st.get_tensor(k) for k in st.keys() if ".experts." in k}
    p = "model.layers.1.mlp.experts.3"
    gate, up, down = (tensors[f"{p}.{w}_proj.weight"].float() for w in ("gate", "up", "down"))
    f_, h = gate.shape

    class Layer:  # what the reader needs of a tiered layer
        num_experts, ffn_hidden_size, hidden_size = 4, f_, h

    for q, etp in ((0, 1), (0, 2), (1, 2)):
        disk, readers = hf_expert_sources(hf, {"layers.1.mlp.experts": Layer()}, (q, etp))
        fl = f_ // etp
        w1, w2 = torch.empty(2 * fl, h), torch.empty(h, fl)
        readers["layers.1.mlp.experts"].read(3, w1, w2)
        rows = slice(q * fl, (q + 1) * fl)
        assert torch.equal(w1, torch.cat([gate[rows], up[rows]])) and torch.equal(w2, down[:, rows]), (q, etp)
        disk.close()


def test_missing_or_corrupt_hf_shard_is_one_line_naming_the_file(tmp_path):
    hf = hf_dir("qwen3_moe", "per_expert", tmp_path, shard="40KB")
    ckpt = imported(hf, tmp_path)
    _open(hf, ckpt).close()
    shards = sorted(hf.glob("*.safetensors"))
    assert len(shards) > 2, shards
    victim = shards[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])  # truncated: a tensor ends past the file's end
    with pytest.raises(CheckpointError) as err:
        _open(hf, ckpt)
    assert victim.name in str(err.value) and "\n" not in str(err.value), err.value
    os.remove(victim)
    with pytest.raises(CheckpointError) as err:
        _open(hf, ckpt)
    assert victim.name in str(err.value) and "\n" not in str(err.value), err.value


def test_import_without_experts_then_finetune_and_generate_read_them_from_hf(tmp_path, capsys):
    """``import-hf --experts-in-hf`` writes everything but the routed experts; a tiered fine-tune
    and ``megamoe-generate --expert-budget`` of that checkpoint read them from the HF directory
    (the checkpoint records it) and equal the full import's curve and transformers' tokens."""
    from megamoe.commands.convert import main as convert
    from megamoe.commands.generate import main as generate
    from megamoe.core.errors import MegamoeError
    from megamoe.checkpoint.dcp import read_meta

    hf = hf_dir("qwen3_moe", "stacked", tmp_path)
    full = imported(hf, tmp_path)
    slim = tmp_path / "slim"
    convert(["import-hf", str(hf), str(slim), "--experts-in-hf"])
    assert read_meta(slim)["hf"]["experts_in_hf"]
    index = "".join(p.read_text() for p in slim.rglob("*.index.json"))
    assert "experts.gate_up_weight" not in index and "experts.down_weight" not in index, index
    assert "shared" in index or "router.weight" in index, index  # the rest is there
    resident = finetune(full, str(tmp_path / "resident"), None, steps=STEPS)["losses"]
    tiered = finetune(str(slim), str(tmp_path / "tiered"), 0.006, steps=STEPS)["losses"]
    assert max(abs(a - b) for a, b in zip(resident, tiered)) <= 1e-6, (resident, tiered)
    capsys.readouterr()
    outs = []
    for args in ([str(hf)], [str(slim), "--expert-budget", "0.006"]):
        generate([*args, "--ids", "1,2,3", "--max-new-tokens", "5"])
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip(), outs
    with pytest.raises(MegamoeError) as err:  # all resident: the experts are not in the checkpoint
        generate([str(slim), "--ids", "1,2,3", "--max-new-tokens", "1"])
    assert "--experts-in-hf" in str(err.value) and "\n" not in str(err.value), err.value
