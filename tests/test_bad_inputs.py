"""Bad input to every command: each case asserts the exit status, one line on stderr that names
the culprit (option, field, file or tensor), no traceback, and nothing left behind (the folder
the case works in holds exactly what it held before, byte for byte).

The commands run in process through ``megamoe.commands.cli.run_main``, exactly as their console entry
points (``megamoe-generate`` ...) do, which keeps the ~70 cases to seconds. They all fail before
a process group would be started.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.commands.cli import run_main
from megamoe.commands import convert, finetune, generate, plan, prepare_data, pretrain, show_model, verify
from tests.test_convert_dense import tiny_qwen3

TOOLS = {"generate": generate.main, "verify": verify.main, "convert": convert.main, "plan": plan.main,
         "pretrain": pretrain.main, "finetune": finetune.main, "prepare_data": prepare_data.main,
         "show_model": show_model.main}


def invoke(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one command line run as the console script runs it."""
    with pytest.raises(SystemExit) as e:
        run_main(main, argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` with a hash of its bytes (folders as 'dir')."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def assert_one_line(result, *culprits: str, code: int = 2) -> str:
    status, out, err = result
    lines = err.strip().splitlines()
    assert status == code, (status, out, err)
    assert "Traceback" not in out + err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for c in culprits:
        assert c in lines[0], (c, lines[0])
    return lines[0]


# ---- fixtures: a tiny HF model, its import, tokenizers and files to misuse ------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 HF folder (vocab 96) without tokenizer files."""
    d = tmp_path_factory.mktemp("bad_inputs") / "qwen3"
    tiny_qwen3().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def ckpt(hf_dir) -> Path:
    from megamoe.convert import import_hf

    return import_hf(hf_dir, hf_dir.parent / "ckpt", progress=False)


def with_weights(hf_dir: Path, dest: Path, fn) -> Path:
    shutil.copytree(hf_dir, dest)
    tensors = load_file(dest / "model.safetensors")
    fn(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def unk_only_tokenizer(path: Path) -> Path:
    """A word-level tokenizer.json that knows no English word: every text is <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "zzyzx": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def unrelated_folder(root: Path) -> Path:
    d = root / "my_notes"
    d.mkdir()
    (d / "thesis.txt").write_text("years of work")
    (d / "config.json").write_text("{}")  # a config.json alone is not an HF checkpoint
    return d


# ---- cases: (tool, argv with {hf} {ckpt} {tmp} placeholders, culprits) --------------------

CASES = {
    # generate: numbers, ids, prompt and tokenizer
    "gen max-new-tokens -5": ("generate", ["{hf}", "--ids", "1,2", "--max-new-tokens", "-5"], ["--max-new-tokens", "-5"]),
    "gen max-new-tokens 0": ("generate", ["{hf}", "--ids", "1", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    "gen max-new-tokens x": ("generate", ["{hf}", "--ids", "1", "--max-new-tokens", "x"], ["--max-new-tokens", "'x'"]),
    "gen beyond max_seq_len": ("generate", ["{hf}", "--ids", "1,2", "--max-new-tokens", "100000000000"],
                               ["--max-new-tokens 100000000000", "max_seq_len 32768"]),
    "gen ids 999": ("generate", ["{hf}", "--ids", "999"], ["999", "vocab_size 96"]),
    "gen ids -3": ("generate", ["{hf}", "--ids", "-3"], ["--ids", "-3", "negative"]),
    "gen ids 5,abc": ("generate", ["{hf}", "--ids", "5,abc"], ["--ids", "'abc'"]),
    "gen ids 1,,2": ("generate", ["{hf}", "--ids", "1,,2"], ["--ids", "''"]),
    "gen temperature 0": ("generate", ["{hf}", "--ids", "1", "--sample", "--temperature", "0"], ["--temperature"]),
    "gen temperature nan": ("generate", ["{hf}", "--ids", "1", "--temperature", "nan"], ["--temperature", "nan"]),
    "gen top-p 1.5": ("generate", ["{hf}", "--ids", "1", "--top-p", "1.5"], ["--top-p", "1.5"]),
    "gen top-k -1": ("generate", ["{hf}", "--ids", "1", "--top-k", "-1"], ["--top-k", "-1"]),
    "gen seed -1": ("generate", ["{hf}", "--ids", "1", "--seed", "-1"], ["--seed"]),
    "gen no prompt": ("generate", ["{hf}"], ["--prompt", "--ids"]),
    "gen missing model": ("generate", ["{tmp}/nowhere", "--ids", "1"], ["nowhere", "meta.json"]),
    "gen one-id tokenizer": ("generate", ["{hf}", "--prompt", "Hello"], ["tokenizer", "qwen3", "1 id"]),
    "gen unk tokenizer": ("generate", ["{hf}", "--prompt", "Hello", "--tokenizer", "{tmp}/unk/tokenizer.json"],
                          ["unk/tokenizer.json", "unknown tokens only"]),
    "gen missing tokenizer": ("generate", ["{hf}", "--prompt", "Hi", "--tokenizer", "{tmp}/tok.model"], ["tok.model", "not found"]),
    "gen image on text model": ("generate", ["{hf}", "--ids", "1", "--image", "{tmp}/a.png"], ["--image", "no vision tower"]),
    "gen image missing": ("generate", ["{hf}", "--ids", "1", "--image", "{tmp}/nope.png"], ["nope.png"]),
    "gen unknown option": ("generate", ["{hf}", "--ids", "1", "--beams", "4"], ["--beams"]),
    # verify
    "verify prompt-len 0": ("verify", ["{hf}", "--prompt-len", "0"], ["--prompt-len", "0"]),
    "verify tokens 0": ("verify", ["{hf}", "--tokens", "0"], ["--tokens"]),
    "verify atol -1": ("verify", ["{hf}", "--atol", "-1"], ["--atol", "-1"]),
    "verify seed x": ("verify", ["{hf}", "--seed", "x"], ["--seed", "'x'"]),
    "verify missing dir": ("verify", ["{tmp}/nowhere"], ["nowhere"]),
    "verify no hf origin": ("verify", ["{tmp}/native"], ["native", "did not come from an HF checkpoint"]),
    # convert
    "import shard-gib 0": ("convert", ["import-hf", "{hf}", "{tmp}/out", "--shard-gib", "0"], ["--shard-gib", "0"]),
    "import shard-gib -1": ("convert", ["import-hf", "{hf}", "{tmp}/out", "--shard-gib", "-1"], ["--shard-gib"]),
    "export shard-gib 0": ("convert", ["export-hf", "{ckpt}", "{tmp}/out", "--shard-gib", "0"], ["--shard-gib"]),
    "import tp 0": ("convert", ["import-hf", "{hf}", "{tmp}/out", "--tp", "0"], ["--tp", "0"]),
    "import tp 3": ("convert", ["import-hf", "{hf}", "{tmp}/out", "--tp", "3"], ["parallel.tp", "3"]),
    "import missing dir": ("convert", ["import-hf", "{tmp}/nowhere", "{tmp}/out"], ["nowhere/config.json"]),
    "import int32 weights": ("convert", ["import-hf", "{tmp}/int32", "{tmp}/out"],
                             ["model.layers.0.mlp.up_proj.weight", "I32"]),
    "import fp8 weights": ("convert", ["import-hf", "{tmp}/fp8", "{tmp}/out"],
                           ["model.layers.1.self_attn.q_proj.weight", "F8_E4M3"]),
    "import over unrelated folder": ("convert", ["import-hf", "{hf}", "{tmp}/my_notes", "--overwrite"],
                                     ["my_notes", "does not look like a checkpoint"]),
    "import over a file": ("convert", ["import-hf", "{hf}", "{tmp}/a.png", "--overwrite"], ["a.png", "not a folder"]),
    "import over existing": ("convert", ["import-hf", "{hf}", "{tmp}/native"], ["native", "already exists"]),
    "export over unrelated folder": ("convert", ["export-hf", "{ckpt}", "{tmp}/my_notes", "--overwrite"],
                                     ["my_notes", "does not look like a checkpoint"]),
    "export not a checkpoint": ("convert", ["export-hf", "{tmp}/my_notes", "{tmp}/out"], ["my_notes", "meta.json"]),
    "export unknown family": ("convert", ["export-hf", "{ckpt}", "{tmp}/out", "--family", "gpt9"], ["model_type='gpt9'"]),
    "export no family": ("convert", ["export-hf", "{tmp}/native", "{tmp}/out"], ["native", "--family"]),
    "export-peft not lora": ("convert", ["export-peft", "{ckpt}", "{tmp}/out"], ["meta.json", "not a LoRA checkpoint"]),
    "convert no command": ("convert", [], ["command"]),
    "convert unknown command": ("convert", ["import"], ["'import'"]),
    # plan: what the trainer refuses
    "plan cp 2": ("plan", ["--config", "tiny_dense", "parallel.cp=2"], ["parallel.tp*pp*cp", "world size 1"]),
    "plan world-size 0": ("plan", ["--config", "tiny_dense", "--world-size", "0"], ["--world-size", "0"]),
    "plan world-size 3 tp 2": ("plan", ["--config", "tiny_dense", "--world-size", "3", "parallel.tp=2"],
                               ["parallel.tp*pp*cp", "world size 3"]),
    "plan global batch": ("plan", ["--config", "tiny_dense", "--world-size", "16", "train.global_batch_size=8"],
                          ["train.global_batch_size=8", "micro_batch_size*dp"]),
    "plan huge repeat": ("plan", ["--config", "tiny_dense", "model.layout=(GeAd)*20000000"],
                         ["model.layout", "40,000,000 layers"]),
    "plan nested repeat": ("plan", ["--config", "tiny_dense", "model.layout=((Ad)*1000)*1000"], ["model.layout", "1,000,000"]),
    "plan grad bucket 0": ("plan", ["--config", "tiny_dense", "train.grad_bucket_size=0"], ["train.grad_bucket_size"]),
    "plan vpp without pp": ("plan", ["--config", "tiny_dense", "parallel.vpp=2"], ["parallel.vpp"]),
    "plan mrope under pp": ("plan", ["--config", "quickstart_vlm", "--world-size", "2", "parallel.pp=2"],
                            ["parallel.pp", "mrope_section"]),
    "plan unknown recipe": ("plan", ["--config", "no_such_recipe"], ["no_such_recipe", "not found"]),
    "plan not key=value": ("plan", ["--config", "tiny_dense", "parallel.tp"], ["'parallel.tp'", "key=value"]),
    "plan unknown key": ("plan", ["--config", "tiny_dense", "model.nope=1"], ["nope"]),
    "plan tp not int": ("plan", ["--config", "tiny_dense", "parallel.tp=two"], ["parallel.tp"]),
    "plan no config": ("plan", [], ["--config"]),
    "plan lora rank 0": ("plan", ["--config", "tiny_moe_lora", "lora.rank=0"], ["lora.rank"]),
    # pretrain / finetune: refused before any process group or data loading
    "pretrain cp 2": ("pretrain", ["--config", "tiny_train", "parallel.cp=2"], ["parallel.tp*pp*cp", "world size 1"]),
    "pretrain steps 0": ("pretrain", ["--config", "tiny_train", "train.steps=0"], ["train.steps"]),
    "pretrain huge repeat": ("pretrain", ["--config", "tiny_train", "model.layout=(GeAd)*20000000"], ["model.layout"]),
    "pretrain one-id tokenizer": ("pretrain", ["--config", "tiny_train", "data.tokenizer={hf}"], ["tokenizer", "1 id"]),
    "pretrain unk tokenizer": ("pretrain", ["--config", "tiny_train", "data.tokenizer={tmp}/unk/tokenizer.json"],
                               ["unk/tokenizer.json", "sample text"]),
    "pretrain missing tokenizer": ("pretrain", ["--config", "tiny_train", "data.tokenizer={tmp}/t.model"], ["t.model"]),
    "pretrain vocab below tokenizer": ("pretrain", ["--config", "tiny_train", "model.vocab_size=100"],
                                       ["model.vocab_size=100", "262"]),
    "pretrain bad yaml": ("pretrain", ["--config", "{tmp}/bad.yaml"], ["bad.yaml"]),
    "pretrain recipe not mapping": ("pretrain", ["--config", "{tmp}/list.yaml"], ["list.yaml", "mapping"]),
    "export-peft over unrelated": ("convert", ["export-peft", "{ckpt}", "{tmp}/my_notes", "--overwrite"], ["my_notes"]),
    # prepare_data / show_model
    "prepare over unrelated folder": ("prepare_data", ["{tmp}/bad.yaml", "--tokenizer", "byte", "--output",
                                                       "{tmp}/my_notes", "--overwrite"], ["my_notes", "token directory"]),
    "prepare one-id tokenizer": ("prepare_data", ["{tmp}/bad.yaml", "--tokenizer", "{hf}", "--output", "{tmp}/t"],
                                 ["tokenizer", "1 id"]),
    "prepare missing input": ("prepare_data", ["{tmp}/none.txt", "--tokenizer", "byte", "--output", "{tmp}/t"],
                              ["none.txt"]),
    "prepare show not tokens": ("prepare_data", ["--show", "{tmp}/my_notes"], ["my_notes"]),
    "show_model batch 0": ("show_model", ["--config", "tiny_dense", "--batch", "0"], ["--batch", "0"]),
    "show_model huge repeat": ("show_model", ["--config", "tiny_dense", "model.layout=(GeAd)*20000000"], ["model.layout"]),
    "finetune without load": ("finetune", ["--config", "tiny_moe_lora", "data.paths=[{tmp}/a.png]"], ["checkpoint.load"]),
    "finetune lora alpha": ("finetune", ["--config", "tiny_moe_lora", "lora.alpha=-1"], ["lora.alpha"]),
}


@pytest.fixture(scope="module")
def workspace(hf_dir, ckpt, tmp_path_factory) -> Path:
    """The files the cases point at ({tmp}); each case runs on a fresh copy."""
    from PIL import Image

    from megamoe.convert import build_model
    from megamoe.core.config_io import config_from_dict
    from megamoe.checkpoint.dcp import read_meta, save_checkpoint

    root = tmp_path_factory.mktemp("workspace")
    unk_only_tokenizer(root / "unk" / "tokenizer.json")
    Image.new("RGB", (8, 8)).save(root / "a.png")
    (root / "bad.yaml").write_text("model: {hidden_size: [\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")

    def to_int32(t):
        t["model.layers.0.mlp.up_proj.weight"] = (t["model.layers.0.mlp.up_proj.weight"] * 100).to(torch.int32)

    def to_fp8(t):
        name = "model.layers.1.self_attn.q_proj.weight"
        t[name] = t[name].to(torch.float8_e4m3fn)

    with_weights(hf_dir, root / "int32", to_int32)
    with_weights(hf_dir, root / "fp8", to_fp8)
    # a megamoe training checkpoint of a model that never was an HF checkpoint
    model = build_model(config_from_dict(read_meta(ckpt)["model"]))
    save_checkpoint(root / "run", 1, model.groups, [model], extra_meta={"model": read_meta(ckpt)["model"]})
    shutil.move(root / "run" / "step_00000001", root / "native")
    shutil.rmtree(root / "run")
    return root


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, workspace, hf_dir, ckpt, tmp_path, capsys):
    tool, argv, culprits = CASES[case]
    tmp = tmp_path / "w"
    shutil.copytree(workspace, tmp)
    unrelated_folder(tmp)
    sub = {"{hf}": str(hf_dir), "{ckpt}": str(ckpt), "{tmp}": str(tmp)}
    for k, v in sub.items():
        argv = [a.replace(k, v) for a in argv]
    before, hf_before, ckpt_before = snapshot(tmp), snapshot(hf_dir), snapshot(ckpt)
    assert_one_line(invoke(TOOLS[tool], argv, capsys), *culprits)
    assert snapshot(tmp) == before, "the command left files behind or changed them"
    assert snapshot(hf_dir) == hf_before and snapshot(ckpt) == ckpt_before


def test_overwrite_replaces_only_megamoe_output(hf_dir, ckpt, tmp_path, capsys):
    """--overwrite replaces a checkpoint megamoe wrote (and an HF checkpoint), keeps an unrelated
    folder and a stray '<name>.tmp' folder of the user's untouched."""
    out = tmp_path / "out"
    stray = tmp_path / "out.tmp"
    stray.mkdir()
    (stray / "keep.txt").write_text("mine")
    run_main(convert.main, ["import-hf", str(hf_dir), str(out)])
    first = json.loads((out / "meta.json").read_text())
    (out / "marker").write_text("old")  # goes when the folder is replaced
    run_main(convert.main, ["import-hf", str(hf_dir), str(out), "--overwrite", "--tp", "2"])
    assert json.loads((out / "meta.json").read_text())["layout"]["tp"] == 2 != first["layout"]["tp"]
    assert not (out / "marker").exists()
    run_main(convert.main, ["export-hf", str(out), str(tmp_path / "hf")])
    run_main(convert.main, ["export-hf", str(out), str(tmp_path / "hf"), "--overwrite"])  # an HF checkpoint
    assert (stray / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out", "out.tmp"]  # no temporary folders left
    capsys.readouterr()


def test_debug_flag_and_env_show_the_traceback(monkeypatch, capsys):
    from megamoe.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel\.tp\*pp\*cp"):
        run_main(plan.main, ["--config", "tiny_dense", "parallel.cp=2", "--debug"])
    monkeypatch.setenv("MEGAMOE_DEBUG", "1")
    with pytest.raises(ConfigError, match=r"parallel\.tp\*pp\*cp"):
        run_main(plan.main, ["--config", "tiny_dense", "parallel.cp=2"])
    monkeypatch.setenv("MEGAMOE_DEBUG", "0")
    assert_one_line(invoke(plan.main, ["--config", "tiny_dense", "parallel.cp=2"], capsys), "parallel.tp*pp*cp")


def test_prepare_data_replaces_its_own_output(tmp_path):
    """--overwrite replaces a token directory megamoe-prepare-data wrote."""
    text = tmp_path / "a.txt"
    text.write_text("hello world\n\nsecond document\n")
    args = [str(text), "--tokenizer", "byte", "--no-progress", "--output", str(tmp_path / "tok")]
    run_main(prepare_data.main, args)
    (tmp_path / "tok" / "stale").write_text("x")
    run_main(prepare_data.main, [*args, "--overwrite"])
    assert json.loads((tmp_path / "tok" / "header.json").read_text())["num_documents"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "tok"] and not (tmp_path / "tok" / "stale").exists()


def masked_batch_step() -> str:
    """One trainer step on a batch whose labels are all masked (in a pool process: the trainer
    joins the process group there)."""
    from megamoe.parallel.cross_entropy import IGNORE_INDEX
    from megamoe.core.errors import DataError
    from megamoe.recipe import load_train_recipe
    from megamoe.training.trainer import Trainer

    recipe = load_train_recipe("tiny_train", ["train.global_batch_size=4", "logging.progress=false"])
    trainer = Trainer(recipe)
    ids = torch.randint(0, 200, (4, recipe.data.seq_len))
    try:
        trainer.train_step([{"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)}])
    except DataError as e:
        return str(e)
    return "no error"


def test_training_refuses_a_batch_without_targets(pool):
    msg = pool(1).run(masked_batch_step)[0]
    assert "step 1" in msg and "no target tokens" in msg and "\n" not in msg, msg


def test_tokenizer_far_smaller_than_the_vocabulary_is_said(caplog):
    from megamoe.data import check_vocab
    from megamoe.data.tokenizer import ByteTokenizer

    with caplog.at_level("WARNING", logger="megamoe.data.loader"):
        check_vocab(ByteTokenizer(), 320)
        assert not caplog.records
        check_vocab(ByteTokenizer(), 151936)
    assert len(caplog.records) == 1 and "151936" in caplog.records[0].getMessage()
