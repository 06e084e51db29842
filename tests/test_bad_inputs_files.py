"""Hostile and careless files, folders and signals (issue 41, part A): an output is never its
input, one run per checkpoint folder, nothing read from outside a checkpoint, hostile headers and
JSON as one line, SIGTERM/SIGINT leave nothing half-written, no secrets in a run's record, and a
run that fails before its first step leaves nothing behind.

Each case asserts exit status 2 (128 + the signal for an interruption), one line on stderr naming
the culprit, no traceback, the user's files byte-identical after and nothing left behind. Most
run in process through ``run_main`` as the console scripts do (tests/test_bad_inputs.py); the
lock and signal cases need real processes.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megamoe.commands import convert, finetune, generate, prepare_data, pretrain
from tests.test_bad_inputs import assert_one_line, ckpt, hf_dir, invoke  # noqa: F401  (fixtures)
from tests.test_checkpoint_safety import LOG_LINE, REPO
from tests.test_checkpoint_safety import env as tool_env

TOOLS = {"convert": convert.main, "pretrain": pretrain.main, "finetune": finetune.main,
         "prepare_data": prepare_data.main, "generate": generate.main}
SMALL = ["data.seq_len=32", "train.steps=2", "logging.progress=false", "logging.latency_interval=0"]


@pytest.fixture
def user(hf_dir, ckpt, tmp_path) -> Path:  # noqa: F811
    """A user's folder: copies of the HF model and the converted checkpoint, text and a tokenizer."""
    root = tmp_path / "u"
    shutil.copytree(hf_dir, root / "hf")
    (root / "hf" / "tokenizer.json").write_text('{"mine": true}')  # the user's file beside the weights
    shutil.copytree(ckpt, root / "ck")
    (root / "ck" / "hf").mkdir()
    (root / "ck" / "hf" / "notes.txt").write_text("a user's subfolder")
    (root / "docs").mkdir()
    (root / "docs" / "a.txt").write_text("hello world\n\nsecond document\n")
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root``: a hash of a file's bytes, a link's target, 'dir' or 'fifo' (never
    read: reading a FIFO blocks)."""
    def state(p: Path) -> str:
        if p.is_symlink():
            return f"-> {os.readlink(p)}"
        if p.is_dir():
            return "dir"
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "fifo"
    return {str(p.relative_to(root)): state(p) for p in sorted(root.rglob("*"))}


def run_case(user: Path, tool: str, argv: list[str], capsys, *culprits: str, code: int = 2) -> str:
    """Run one command line on ``{u}``-placeholders; the user's folder stays byte-identical."""
    argv = [a.replace("{u}", str(user)) for a in argv]
    before = snapshot(user)
    line = assert_one_line(invoke(TOOLS[tool], argv, capsys), *[c.replace("{u}", str(user)) for c in culprits],
                           code=code)
    assert snapshot(user) == before, "the command changed the user's files or left some behind"
    return line


# ---- 1. an output is never its input, inside it, or holding it -----------------------------

OVERLAP = {
    "import-hf onto its input": ("convert", ["import-hf", "{u}/hf", "{u}/hf", "--overwrite"], ["is the input HF_DIR"]),
    "import-hf inside its input": ("convert", ["import-hf", "{u}/hf", "{u}/hf/mm"], ["is inside the input HF_DIR"]),
    "import-hf holding its input": ("convert", ["import-hf", "{u}/hf", "{u}", "--overwrite"], ["holds the input"]),
    "export-hf onto its input": ("convert", ["export-hf", "{u}/ck", "{u}/ck", "--overwrite"], ["is the input CKPT_DIR"]),
    "export-hf inside its input": ("convert", ["export-hf", "{u}/ck", "{u}/ck/hf2"], ["{u}/ck/hf2", "is inside"]),
    "export-hf into a user's subfolder": ("convert", ["export-hf", "{u}/ck", "{u}/ck/hf", "--overwrite"], ["is inside"]),
    "export-peft onto its input": ("convert", ["export-peft", "{u}/ck", "{u}/ck", "--overwrite"], ["is the input"]),
    "prepare-data holding its input": ("prepare_data", ["{u}/docs/a.txt", "--tokenizer", "byte", "--output",
                                                        "{u}/docs", "--overwrite"], ["--output {u}/docs", "holds"]),
    "prepare-data megatron onto its input": ("prepare_data", ["{u}/docs/a.bin", "--tokenizer", "byte", "--format",
                                                              "megatron", "--output", "{u}/docs/a", "--overwrite"],
                                             ["{u}/docs/a.bin", "is the input file {u}/docs/a.bin"]),
    "prepare-data holding its tokenizer": ("prepare_data", ["{u}/docs/a.txt", "--tokenizer", "{u}/hf/tokenizer.json",
                                                            "--output", "{u}/hf", "--overwrite"], ["--tokenizer"]),
    "pretrain checkpoint.dir holding the data": ("pretrain", ["--config", "tiny_train", "data.kind=pretrain",
                                                              "data.paths=[{u}/docs/a.tokens]", "checkpoint.dir={u}/docs",
                                                              *SMALL], ["checkpoint.dir", "data.paths[0]"]),
    "pretrain logging.dir inside a validation folder": ("pretrain", ["--config", "tiny_train", "eval.interval=1",
                                                                     "eval.paths=[{u}/docs]", "logging.dir={u}/docs/tb",
                                                                     "checkpoint.dir={u}/run",
                                                                     *SMALL], ["logging.dir", "eval.paths[0]"]),
    "finetune checkpoint.dir is checkpoint.load": ("finetune", ["--config", "tiny_train", "checkpoint.load={u}/ck",
                                                                "checkpoint.dir={u}/ck", *SMALL],
                                                   ["checkpoint.dir", "is the input checkpoint.load"]),
}


@pytest.mark.parametrize("case", list(OVERLAP))
def test_output_apart_from_input(case, user, capsys):
    tool, argv, culprits = OVERLAP[case]
    run_case(user, tool, argv, capsys, *culprits)


def test_export_merge_never_writes_onto_its_base(user, capsys):
    """--base is an input of export-hf --merge: the merged model is never written over it."""
    run_case(user, "convert", ["export-hf", "{u}/ck", "{u}/hf", "--merge", "--base", "{u}/hf", "--overwrite"],
             capsys, "is the input --base")


# ---- 3. a checkpoint names only regular files inside its own folder ------------------------

def index_to(folder: Path, target: str) -> None:
    """Point every tensor of ``folder``'s safetensors index (written if absent) at ``target``."""
    from megamoe.checkpoint.safetensors_io import read_header

    index = folder / "model.safetensors.index.json"
    names = json.loads(index.read_text())["weight_map"] if index.exists() else read_header(folder / "model.safetensors")
    index.write_text(json.dumps({"weight_map": {n: target for n in names}}))


def outside_shard(user: Path, where: str) -> None:
    """The HF copy's weights moved out of it and named from its index."""
    index_to(user / "hf", {"up": "../outside.safetensors", "abs": str(user / "outside.safetensors"),
                           "dev": "/dev/zero"}[where])
    os.replace(user / "hf/model.safetensors", user / "outside.safetensors")


def fifo_shard(user: Path, ck: bool) -> None:
    folder = user / ("ck" if ck else "hf")
    os.mkfifo(folder / "fifo.safetensors")  # reading it would block forever
    index_to(folder, "fifo.safetensors")


def symlinked_out(user: Path) -> None:
    """The converted checkpoint's shard replaced by a symlink to a file outside it."""
    os.replace(user / "ck/model.safetensors", user / "outside.safetensors")
    os.symlink(user / "outside.safetensors", user / "ck/model.safetensors")


OUTSIDE = {
    "import-hf index ../": (lambda u: outside_shard(u, "up"), ["import-hf", "{u}/hf", "{u}/out"],
                            ["model.safetensors.index.json", "'../outside.safetensors'"]),
    "import-hf index absolute": (lambda u: outside_shard(u, "abs"), ["import-hf", "{u}/hf", "{u}/out"],
                                 ["model.safetensors.index.json", "{u}/outside.safetensors"]),
    "import-hf index /dev/zero": (lambda u: outside_shard(u, "dev"), ["import-hf", "{u}/hf", "{u}/out"], ["'/dev/zero'"]),
    "import-hf index FIFO": (lambda u: fifo_shard(u, ck=False), ["import-hf", "{u}/hf", "{u}/out"],
                             ["fifo.safetensors", "not a regular file"]),
    "generate converted index FIFO": (lambda u: fifo_shard(u, ck=True), ["{u}/ck", "--ids", "1"],
                                      ["fifo.safetensors", "not a regular file"]),
    "generate converted symlink out": (symlinked_out, ["{u}/ck", "--ids", "1"], ["model.safetensors", "leads outside"]),
    "export-hf converted symlink out": (symlinked_out, ["export-hf", "{u}/ck", "{u}/out"], ["leads outside"]),
}


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_checkpoint_names_only_its_own_files(case, user, capsys):
    prepare, argv, culprits = OUTSIDE[case]
    prepare(user)
    run_case(user, "generate" if case.startswith("generate") else "convert", argv, capsys, *culprits)


def test_hub_cache_symlinks_are_followed(hf_dir, tmp_path):  # noqa: F811
    """The Hugging Face hub cache's layout (snapshots/<rev>/file -> ../../blobs/<hash>) is how
    downloaded models arrive: its symlinks leave the snapshot folder but stay in the model's own
    blobs folder, and import-hf reads them."""
    from megamoe.convert import import_hf

    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in hf_dir.iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        os.symlink(f"../../blobs/blob-{f.name}", snap / f.name)
    out = import_hf(snap, tmp_path / "ck", progress=False)
    assert (out / "meta.json").is_file()


# ---- 4. hostile headers and JSON: one line, nothing allocated ------------------------------

def raw_safetensors(path: Path, header, data: bytes = b"\0" * 8) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def hostile_header(header):
    def prepare(user: Path) -> None:
        (user / "hf/model.safetensors").unlink()
        raw_safetensors(user / "hf/model.safetensors", header)
    return prepare


def edit_meta(fn):
    def prepare(user: Path) -> None:
        meta = json.loads((user / "ck/meta.json").read_text())
        fn(meta)
        (user / "ck/meta.json").write_text(json.dumps(meta))
    return prepare


def deep_meta(user: Path) -> None:
    depth = 200_000
    (user / "ck/meta.json").write_text('{"layout": {"tp": 1}, "model": ' + "[" * depth + "]" * depth + "}")


HOSTILE = {
    "header entry not an object": (hostile_header({"w": 5}), ["header entry 'w'", "not an object"]),
    "header without data_offsets": (hostile_header({"w": {"dtype": "F32", "shape": [2]}}), ["'w'", "data_offsets"]),
    "header a list": (hostile_header([1, 2]), ["model.safetensors", "header is a JSON list"]),
    "header negative shape": (hostile_header({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}),
                              ["'w'", "shape [-2]"]),
    "header offsets past the dtype": (hostile_header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}),
                                      ["'w'", "holds 8 bytes"]),
    "weight_map a list": (lambda u: (u / "hf/model.safetensors.index.json").write_text('{"weight_map": [1]}'),
                          ["'weight_map' is a list"]),
    "config.json nested 200000 deep": (lambda u: (u / "hf/config.json").write_text("[" * 200_000 + "]" * 200_000),
                                       ["config.json", "nested deeper than 64 levels"]),
}
META = {
    "meta.json model 'x'": (edit_meta(lambda m: m.update(model="x")), ["meta.json", "'model' is 'x'"]),
    "meta.json nested 200000 deep": (deep_meta, ["meta.json", "nested deeper than 64 levels"]),
    "meta.json hidden_size 1e7": (edit_meta(lambda m: m["model"].update(hidden_size=10_000_000)),
                                  ["meta.json", "hidden_size 10000000", "more than the"]),
    "meta.json vocab_size 1e9": (edit_meta(lambda m: m["model"].update(vocab_size=1_000_000_000)),
                                 ["meta.json", "vocab_size 1000000000", "more than the"]),
    "meta.json layout.tp 1000000": (edit_meta(lambda m: m["layout"].update(tp=1_000_000)),
                                    ["meta.json", "layout.tp=1000000"]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_hf_files_are_one_line(case, user, capsys):
    prepare, culprits = HOSTILE[case]
    prepare(user)
    run_case(user, "convert", ["import-hf", "{u}/hf", "{u}/out"], capsys, *culprits)


@pytest.mark.parametrize("case", list(META))
def test_hostile_meta_json_is_one_line(case, user, capsys):
    prepare, culprits = META[case]
    prepare(user)
    run_case(user, "generate", ["{u}/ck", "--ids", "1"], capsys, *culprits)


# ---- 6. secrets stay out of a run's record ---------------------------------------------------

def test_environment_values_are_refused_in_training_recipes(tmp_path, monkeypatch, capsys):
    """${oc.env:X} would be resolved into recipe.yaml and meta.json: refused, naming the key,
    in the YAML and in an override; planning (which records nothing) still resolves it."""
    monkeypatch.setenv("MEGAMOE_TEST_SECRET", "hunter2")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("logging:\n  wandb:\n    entity: ${oc.env:MEGAMOE_TEST_SECRET}\n")
    line = assert_one_line(invoke(pretrain.main, ["--config", str(recipe)], capsys), "logging.wandb.entity", "oc.env")
    assert "hunter2" not in line
    assert_one_line(invoke(pretrain.main, ["--config", "tiny_train", "data.tokenizer=${oc.env:MEGAMOE_TEST_SECRET}"],
                           capsys), "data.tokenizer")
    from megamoe.recipe import load_train_recipe

    assert load_train_recipe(str(recipe), validate=False).logging.wandb.entity == "hunter2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


# ---- 2, 5, 7: real processes: the lock, signals, a run that fails at once ------------------

TRAIN = ["--config", "tiny_train", "model.hidden_size=32", "data.seq_len=32", "train.global_batch_size=4",
         "train.micro_batch_size=4", "logging.progress=false", "logging.latency_interval=0"]


PROGRESS = re.compile(r"[^\n\r]*\| *\d+/\d+ \[[^\]\n]*\]")  # tqdm's bars (import-hf's, on stderr)


def start(tool: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "tools" / tool), *map(str, args)], env=tool_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Poll until ``condition()``; the process must still be running."""
    end = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} early:\n{proc.communicate()[1][-3000:]}"
        assert time.time() < end, "timed out waiting"
        time.sleep(0.02)


def one_line_error(status: int, stderr: str, *culprits: str, code: int = 2) -> str:
    """Exit ``code``, and stderr's only line that is not a log record is the error, naming ``culprits``."""
    assert status == code, (status, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    stderr = PROGRESS.sub("", stderr)
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    for c in culprits:
        assert c in lines[0], (c, lines[0])
    return lines[0]


def complete_steps(run: Path) -> list[Path]:
    return sorted(p for p in run.glob("step_????????") if (p / "meta.json").is_file())


def test_one_run_per_folder_sigterm_and_mixed_steps(tmp_path, capsys):
    """A trainer holds its checkpoint.dir: a second one is refused naming the holder's pid and host.
    SIGTERM stops the first mid-run (a save every step) with one line naming what it interrupted;
    it leaves no step_X.tmp and no lock, and latest names a complete checkpoint. A .distcp copied
    from the earlier step into the later one is refused (mixed-step weights)."""
    run = tmp_path / "run"
    first = start("pretrain.py", *TRAIN, "train.steps=100000", "checkpoint.save_interval=1",
                  f"checkpoint.dir={run}")
    try:
        wait_for(lambda: len(complete_steps(run)) >= 2, first)
        second = assert_one_line(invoke(pretrain.main, [*TRAIN, "train.steps=2", f"checkpoint.dir={run}"], capsys),
                                 f"checkpoint.dir={run}", "in use by another run", f"pid {first.pid} on ")
        assert socket.gethostname() in second
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    line = one_line_error(first.returncode, err, "interrupted by SIGTERM while", "stays latest", code=128 + signal.SIGTERM)
    latest = json.loads((run / "latest").read_text())["step_dir"]
    assert f"{latest} stays latest" in line or "saving checkpoint" in line, line
    assert (run / latest / "meta.json").is_file()
    assert not [p.name for p in run.iterdir() if p.name.endswith((".tmp", ".replaced", ".lock"))], list(run.iterdir())
    older, newer = complete_steps(run)[-2:]
    shutil.copy(older / "__0_0.distcp", newer / "__0_0.distcp")
    before = snapshot(run)
    assert_one_line(invoke(generate.main, [str(newer), "--ids", "1"], capsys),
                    "__0_0.distcp", f"written at step {int(older.name[5:])}", f"meta.json is step {int(newer.name[5:])}")
    assert snapshot(run) == before


def test_sigint_import_leaves_no_temporary_folder(tmp_path):
    """Ctrl-C (SIGINT) mid import-hf: one line naming the output, no hidden .OUT.tmp-X left; a stale
    temporary folder of an earlier killed run (megamoe's marker, its pid gone) is removed, a
    look-alike folder without the marker (the user's) is kept."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megamoe.core.files import PARTIAL

    hf = tmp_path / "hf"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=32000, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, intermediate_size=704)).save_pretrained(hf)
    dead = subprocess.Popen(["true"])  # a pid that no longer runs
    dead.wait()
    stale, users = tmp_path / ".out.tmp-stale1", tmp_path / ".out.tmp-mine"
    for d in (stale, users):
        d.mkdir()
        (d / "x").write_text("data")
    (stale / PARTIAL).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    out = tmp_path / "out"
    proc = start("convert.py", "import-hf", hf, out, "--shard-gib", "0.001")
    try:
        wait_for(lambda: [p for p in tmp_path.glob(".out.tmp-*") if p not in (stale, users)], proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    one_line_error(proc.returncode, err, f"interrupted by SIGINT while writing {out}", f"{out} was not written", code=128 + signal.SIGINT)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-mine", "hf"]


def failing_runs(tmp: str) -> list[str]:
    """Two runs whose first step fails (a fault injected into the step: the data and model are
    fine), in a pool process (the trainer joins the process group there): one into a folder of the
    user's, one into a new nested folder. Returns their errors."""
    from megamoe.core.errors import DataError
    from megamoe.recipe import load_train_recipe
    from megamoe.training.entry import run_training
    from megamoe.training.trainer import Trainer

    def fail(self, micro):
        raise DataError(f"step {self.step + 1}: injected failure")

    errors, step = [], Trainer.train_step
    Trainer.train_step = fail
    try:
        for where in ("mine", "new/nested/run"):
            try:
                run_training(load_train_recipe("tiny_train", [*TRAIN[2:], f"checkpoint.dir={tmp}/{where}"]))
            except DataError as e:
                errors.append(str(e))
    finally:
        Trainer.train_step = step
    return errors


def test_a_run_failing_at_its_first_step_leaves_nothing(tmp_path, pool):
    """The checkpoint.dir that existed (the user's file in it) is as it was (its tb/ and lock
    gone), the nested one the run created is gone with its parents."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    before = snapshot(tmp_path)
    assert pool(1).run(failing_runs, str(tmp_path))[0] == ["step 1: injected failure"] * 2
    assert snapshot(tmp_path) == before
