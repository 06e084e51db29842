"""Checkpoints as untrusted input: nothing unpickled but plain metadata, DCP's own failures as one
line, resume guards, recoverable saves. Command-line cases run the tools as subprocesses and
assert exit status 2, exactly one message line naming the culprit, no traceback, nothing left."""
from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe.core.errors import CheckpointError
from megamoe.parallel.groups import ParallelGroups
from tests.dist import free_port, side_by_side

REPO = Path(__file__).resolve().parent.parent
SMALL = ["data.kind=synthetic", "data.seq_len=32", "logging.progress=false", "logging.latency_interval=0"]
# log records: megamoe's (logging.basicConfig in megamoe.commands.cli) and torch's own ("[rank0]:W1205 ...")
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|WARNING) |(\[rank\d+\]:)?[IW]\d{4} )")


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MEGAMOE_FUSION="off",
             MASTER_PORT=str(free_port()))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        e.pop(key, None)
    return e


def tool(name: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    return tools((name, *args), check=check)[0]


def tools(*calls: tuple, check: bool = True) -> list[subprocess.CompletedProcess]:
    """``tool(name, *args)`` for each ``(name, *args)`` of ``calls``, side by side."""
    outs = side_by_side([[sys.executable, str(REPO / "tools" / name), *map(str, args)] for name, *args in calls],
                        [env() for _ in calls])  # each its own MASTER_PORT
    for out, (name, *args) in zip(outs, calls):
        if check and out.returncode:
            raise AssertionError(f"{name} {args} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return outs


def one_line_error(out: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, and stderr's only line that is not a log record is the error."""
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---- checkpoints made once for the module ---------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """base: a tiny MoE (tiny_moe_lora's model, hidden size 48 instead of the recipe's 64) after
    1 step; lora: 2 LoRA steps on it by ``checkpoint.load`` alone, adapter-only; dense: tiny_train
    with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("ckpts")
    tools(("pretrain.py", "--config", "tiny_moe_lora", "lora=null", "model.hidden_size=48", "train.steps=1",
           f"checkpoint.dir={root}/base", *SMALL),
          ("pretrain.py", "--config", "tiny_train", "train.steps=4", "checkpoint.save_interval=2",
           "model.hidden_size=32", f"checkpoint.dir={root}/dense", *SMALL))
    tool("finetune.py", "--config", "tiny_moe_lora", "train.steps=2", f"checkpoint.dir={root}/lora",
         f"checkpoint.load={root}/base/step_00000001", *SMALL)
    return {"root": root, "base": root / "base/step_00000001", "lora": root / "lora/step_00000002",
            "lora_dir": root / "lora", "dense_dir": root / "dense", "dense": root / "dense/step_00000004"}


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- 1. nothing but plain metadata is unpickled ----------------------------------------------

def _linear_checkpoint(root: Path) -> Path:
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.checkpoint.dcp import save_checkpoint

    torch.manual_seed(0)
    return save_checkpoint(root, 1, ParallelGroups(), [torch.nn.Linear(2, 2)])


def _plant_bytes_entry(path: Path, key: str, marker: Path) -> None:
    """The exploit: switch ``key`` to BytesStorageMetadata and point it at a pickle that runs a
    command; DCP's default planner would ``torch.load(weights_only=False)`` it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Evil())
    (path / "evil.distcp").write_bytes(payload)
    md = pickle.loads((path / ".metadata").read_bytes())
    md.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in md.storage_data if i.fqn == key]:
        del md.storage_data[index]
    md.storage_data[MetadataIndex(key)] = _StorageInfo("evil.distcp", 0, len(payload))
    (path / ".metadata").write_bytes(pickle.dumps(md))


def test_bytes_entry_exploit_is_refused(tmp_path):
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.checkpoint.dcp import load_checkpoint

    path, marker = _linear_checkpoint(tmp_path), tmp_path / "pwned"
    _plant_bytes_entry(path, "model/weight", marker)
    with pytest.raises(CheckpointError, match=f"{path}: key model/weight is stored as BytesStorageMetadata"):
        load_checkpoint(path, ParallelGroups(), [torch.nn.Linear(2, 2)])
    assert not marker.exists()


def test_planner_refuses_bytes_even_past_the_metadata_check(tmp_path, monkeypatch):
    """The second lock: with the entry check (and the files' stamps) switched off, the load
    planner still refuses."""
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.checkpoint import dcp, safe_dcp
    from megamoe.checkpoint.dcp import load_checkpoint

    path, marker = _linear_checkpoint(tmp_path), tmp_path / "pwned"
    _plant_bytes_entry(path, "model/weight", marker)
    monkeypatch.setattr(safe_dcp, "_check_entries", lambda path, md: None)
    monkeypatch.setattr(dcp, "check_stamps", lambda path, meta: None)
    with pytest.raises(CheckpointError, match="key model/weight is a byte entry"):
        load_checkpoint(path, ParallelGroups(), [torch.nn.Linear(2, 2)])
    assert not marker.exists()


def test_unlisted_classes_and_outside_files_are_refused(tmp_path):
    from collections import Counter

    from megamoe.checkpoint.safe_dcp import read_safe_metadata

    path = _linear_checkpoint(tmp_path)
    good = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(pickle.dumps(Counter(a=1)))
    with pytest.raises(CheckpointError, match=f"{path}: checkpoint metadata refers to collections.Counter"):
        read_safe_metadata(path)
    md = pickle.loads(good)
    index = next(i for i in md.storage_data if i.fqn == "model/bias")
    md.storage_data[index].relative_path = "../../etc/passwd.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="key model/bias points outside the checkpoint"):
        read_safe_metadata(path)
    (path / ".metadata").write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="corrupted checkpoint metadata"):
        read_safe_metadata(path)


def test_dcp_failures_are_one_line(ckpts, tmp_path):
    """torch's CheckpointException is a BaseException: a truncated .distcp, an adapter-only
    checkpoint as base weights, another model's checkpoint, a folder that is not megamoe's."""
    bad = copy(ckpts["dense"], tmp_path / "truncated")
    part = next(bad.glob("*.distcp"))
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # still more bytes than parameters
    foreign = copy(ckpts["dense"], tmp_path / "foreign")
    (foreign / "meta.json").write_text('{"step": 4}')
    bare = copy(ckpts["dense"], tmp_path / "bare")
    (bare / "meta.json").unlink()
    # each refused run its own checkpoint.dir (they run side by side), none of which may appear
    runs = [tmp_path / f"run{i}" for i in range(5)]
    dense = ["--config", "tiny_train", "model.hidden_size=32", "train.steps=1", *SMALL]
    lora = ["--config", "tiny_moe_lora", "train.steps=1", *SMALL]
    outs = tools(("finetune.py", *dense, f"checkpoint.load={bad}", f"checkpoint.dir={runs[0]}"),
                 ("finetune.py", *lora, f"checkpoint.load={ckpts['lora']}", f"checkpoint.dir={runs[1]}"),
                 ("pretrain.py", *lora, "lora=null", f"checkpoint.load={ckpts['dense']}", f"checkpoint.dir={runs[2]}"),
                 ("finetune.py", *dense, f"checkpoint.load={foreign}", f"checkpoint.dir={runs[3]}"),
                 ("finetune.py", *dense, f"checkpoint.load={bare}", f"checkpoint.dir={runs[4]}"), check=False)
    one_line_error(outs[0], f"{bad}: cannot load checkpoint")
    one_line_error(outs[1], f"{ckpts['lora']}: an adapter-only LoRA checkpoint")
    one_line_error(outs[2], f"{ckpts['dense']}: cannot load weights", "model.hidden_size 32 -> 64")
    one_line_error(outs[3], f"{foreign}/meta.json: not a megamoe checkpoint's meta.json")
    one_line_error(outs[4], f"{bare}: not a megamoe checkpoint (meta.json missing)")
    assert not any(run.exists() for run in runs)


# ---- 2. resume guards --------------------------------------------------------------------------

def test_finetune_takes_the_model_from_the_checkpoint(ckpts):
    """The fixture's LoRA run gave only checkpoint.load; the recipe says hidden_size 64, the base 48."""
    from megamoe.checkpoint.dcp import read_meta

    meta = read_meta(ckpts["lora"])
    assert meta["model"]["hidden_size"] == 48 and meta["lora_base"] == str(ckpts["base"].resolve())
    assert meta["run"]["train"]["global_batch_size"] == 8 and meta["lora"]["rank"] == 8


def test_changed_settings_are_refused_on_resume_and_load(ckpts, tmp_path):
    moe = ["--config", "tiny_moe_lora", "train.steps=3", *SMALL]
    base_run = copy(ckpts["base"].parent, tmp_path / "base")
    lora_run = copy(ckpts["lora_dir"], tmp_path / "lora")
    outs = tools(("pretrain.py", *moe, "lora=null", "model.hidden_size=48", "model.moe.top_k=1", "optim.lr=0.01",
                  f"checkpoint.dir={base_run}"),
                 ("finetune.py", *moe, "lora.rank=4", f"checkpoint.dir={lora_run}"),
                 ("finetune.py", *moe, "model.moe.top_k=1", f"checkpoint.load={ckpts['base']}",
                  f"checkpoint.dir={tmp_path}/new"), check=False)
    one_line_error(outs[0], f"{base_run}/step_00000001: cannot resume", "model.moe.top_k 2 -> 1",
                   "optim.lr 0.002 -> 0.01", "checkpoint.allow_changes=[model.moe.top_k,optim.lr]")
    one_line_error(outs[1], "cannot resume", "lora.rank 8 -> 4")
    one_line_error(outs[2], f"{ckpts['base']}: cannot load weights", "model.moe.top_k 2 -> 1")
    assert read_text_tree(base_run) == read_text_tree(ckpts["base"].parent)  # meta.json not rewritten
    assert not (tmp_path / "new").exists()


def read_text_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and "tb" not in p.parts}


def test_allowed_changes_are_logged_and_unrecorded_fields_skipped(caplog):
    from megamoe.training.guards import check_unchanged

    meta = {"model": {"moe": {"top_k": 2}, "hidden_size": 8}, "run": {"optim": {"lr": 0.1}}}
    with caplog.at_level("WARNING"):
        check_unchanged(Path("ck"), meta, {"model": {"moe": {"top_k": 4}, "hidden_size": 8, "new_field": 1},
                                           "optim": {"lr": 0.1}, "data": {"seed": 3}}, ["model.moe"])
    assert "ck: model.moe.top_k changed from 2 to 4 (allowed by checkpoint.allow_changes)" in caplog.text
    with pytest.raises(CheckpointError, match=r"in model.hidden_size 8 -> 9; lora null -> \{...\} \("):
        check_unchanged(Path("ck"), meta, {"model": {"hidden_size": 9}, "lora": {"rank": 4}})


def test_resume_from_an_earlier_step_logs_each_step_once(ckpts, tmp_path):
    """metrics.jsonl after a run resumed from step 2 of 4: steps 1..4, each once."""
    import json

    run = copy(ckpts["dense_dir"], tmp_path / "dense")
    (run / "latest").write_text(json.dumps({"step_dir": "step_00000002"}))
    shutil.rmtree(run / "step_00000004")
    tool("pretrain.py", "--config", "tiny_train", "train.steps=4", "model.hidden_size=32", f"checkpoint.dir={run}", *SMALL)
    steps = [json.loads(line)["step"] for line in (run / "tb/metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


# ---- 3. saves that fail leave the previous state; resume falls back; reruns; ports ------------

DISK_FULL_AT_SAVE_2 = """
import errno, sys
import torch.distributed.checkpoint.filesystem as fs
from megamoe.checkpoint import dcp as checkpoint
real_write, saves = fs._write_item, []
real_save = checkpoint.save_checkpoint
def counting_save(*a, **k):
    saves.append(1)
    return real_save(*a, **k)
def full_disk_write(transforms, stream, data, *a, **k):
    if len(saves) == 2:  # the second save: some bytes land, then the disk is full
        stream.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_write(transforms, stream, data, *a, **k)
fs._write_item, checkpoint.save_checkpoint = full_disk_write, counting_save
sys.argv = sys.argv[1:]
from megamoe.commands.pretrain import cli
cli()
"""


def test_failed_write_keeps_previous_latest_and_no_tmp(tmp_path):
    run = tmp_path / "run"
    args = ["--config", "tiny_train", "model.hidden_size=32", "train.steps=4", "checkpoint.save_interval=2",
            f"checkpoint.dir={run}", *SMALL]
    out = subprocess.run([sys.executable, "-c", DISK_FULL_AT_SAVE_2, "pretrain", *args], capture_output=True,
                         text=True, env=env(), timeout=300)
    one_line_error(out, f"{run}/step_00000004.tmp: cannot save checkpoint", "No space left on device",
                   "the partial save was removed, step_00000002 stays latest")
    from megamoe.checkpoint.dcp import latest_checkpoint

    assert latest_checkpoint(run) == run / "step_00000002"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_00000002", "tb"]


def test_free_disk_is_checked_before_writing(tmp_path, monkeypatch):
    import shutil as real_shutil

    from megamoe.checkpoint import dcp as checkpoint

    _linear_checkpoint(tmp_path)
    usage = real_shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(CheckpointError, match=f"{tmp_path}: not enough free disk for checkpoint step 2 "
                                              r"\(1.0 MiB needed on a rank, 0.0 MiB free\); nothing written"):
        checkpoint.save_checkpoint(tmp_path, 2, ParallelGroups(), [torch.nn.Linear(2, 2)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]


def test_truncated_newest_falls_back_and_rerun_is_a_no_op(ckpts, tmp_path):
    """The newest checkpoint's data cut short: resume from the one before it, saying so, and
    replace the broken folder when its step comes round again. Then the same recipe with fewer
    steps is nothing to do (no 'Directory not empty'); both runs without MASTER_PORT while
    port 29500 is taken (a second single-process run used to fail with EADDRINUSE)."""
    import json
    import socket

    run = copy(ckpts["dense_dir"], tmp_path / "dense")
    part = next((run / "step_00000004").glob("*.distcp"))
    part.write_bytes(part.read_bytes()[:1000])
    args = ["--config", "tiny_train", "model.hidden_size=32", "checkpoint.save_interval=2", f"checkpoint.dir={run}",
            *SMALL]
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 29500))
    except OSError:
        pass  # taken already, as wanted
    free_env = {k: v for k, v in env().items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    try:
        out = subprocess.run([sys.executable, str(REPO / "tools/pretrain.py"), *args, "train.steps=5"],
                             capture_output=True, text=True, env=free_env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert re.search(r"WARNING .*step_00000004: cannot load checkpoint .*; falling back to the checkpoint "
                         r"before it, .*step_00000002\n", out.stderr), out.stderr[-3000:]
        assert "resumed from" in out.stderr and "step_00000002 at step 2" in out.stderr
        steps = [json.loads(line)["step"] for line in (run / "tb/metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4, 5]
        assert sorted(p.name for p in run.glob("step_*")) == ["step_00000004", "step_00000005"]
        again = subprocess.run([sys.executable, str(REPO / "tools/pretrain.py"), *args, "train.steps=3"],
                               capture_output=True, text=True, env=free_env, timeout=300)
        assert again.returncode == 0 and "nothing trained" in again.stdout, again.stderr[-3000:]
        assert sorted(p.name for p in run.glob("step_*")) == ["step_00000004", "step_00000005"]
    finally:
        holder.close()


def test_nonfinite_stop_is_one_line_and_keeps_the_last_finite_latest(tmp_path):
    from megamoe.checkpoint.dcp import latest_checkpoint, read_meta

    run = tmp_path / "run"
    out = tool("pretrain.py", "--config", "tiny_train", "model.hidden_size=32", "train.steps=12",
               "train.nan_max_consecutive=2", "optim.lr=1e30", "optim.min_lr=0", "optim.warmup_steps=0",
               "optim.clip_grad=0", "checkpoint.save_interval=1", f"checkpoint.dir={run}", *SMALL, check=False)
    line = one_line_error(out, "consecutive steps had a non-finite gradient norm; stopped without saving")
    latest = latest_checkpoint(run)
    state = read_meta(latest)["trainer_state"]
    assert f"{latest} stays latest" in line and state["nan_streak"] == 0 and state["skipped_steps"] == 0
    stopped = int(re.search(r"error: step (\d+):", line).group(1))
    assert state["step"] == stopped - 2
