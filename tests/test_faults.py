"""Faults at scale, on one machine: a rank killed mid-run under ``torchrun --max-restarts 1`` (two
"nodes" meeting by c10d rendezvous, one process each) restarts, resumes and ends with the loss
curve of an uninterrupted run; an asynchronous save killed midway leaves the previous checkpoint
``latest``; a hung rank ends the run with one line naming the step and the group."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.dist import free_port
from tests.test_checkpoint_safety import LOG_LINE, REPO, SMALL, env

# a pretrain run in which rank FAULT_RANK, before step FAULT_AT, is killed (FAULT=kill) or hangs
# (FAULT=hang) once: the marker file keeps a restarted run from doing it again
FAULTY_PRETRAIN = """
import os, signal, sys, time
from pathlib import Path
from megamoe.training import trainer
mode, at, rank = os.environ["FAULT"], int(os.environ["FAULT_AT"]), int(os.environ.get("FAULT_RANK", "1"))
marker = Path(os.environ["FAULT_MARKER"])
real = trainer.Trainer.train_step
def train_step(self, micro):
    if self.rank == rank and self.step + 1 == at and not marker.exists():
        marker.touch()
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    return real(self, micro)
trainer.Trainer.train_step = train_step
sys.argv = ["megamoe-pretrain", *sys.argv[1:]]
from megamoe.commands.pretrain import cli
cli()
"""

STEPS = 8


def run_args(ckpt_dir: Path, *extra: str) -> list[str]:
    return ["--config", "tiny_train", "model.hidden_size=32", f"train.steps={STEPS}", "checkpoint.save_interval=2",
            f"checkpoint.dir={ckpt_dir}", *SMALL, *extra]


def fault_env(tmp_path: Path, mode: str, at: int) -> dict:
    e = {k: v for k, v in env().items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    return {**e, "FAULT": mode, "FAULT_AT": str(at), "FAULT_MARKER": str(tmp_path / f"{mode}.done")}


def losses(ckpt_dir: Path) -> dict[int, float]:
    lines = (ckpt_dir / "tb" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == sorted(set(steps)), steps  # each step once
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in lines}


def two_node_run(tmp_path: Path, name: str, mode: str, at: int) -> Path:
    """``torchrun --nnodes 2`` twice on this machine (one process per "node"), c10d rendezvous,
    ``--max-restarts 1``, async saves; returns the checkpoint folder."""
    script = tmp_path / "faulty_pretrain.py"
    script.write_text(FAULTY_PRETRAIN)
    ckpt_dir, port = tmp_path / name, free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
           "--max-restarts", "1", "--monitor-interval", "1", str(script),
           *run_args(ckpt_dir, "checkpoint.async_save=true")]
    e = fault_env(tmp_path, mode, at)
    nodes = [subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for _ in range(2)]
    try:
        outs = [n.communicate(timeout=600)[0] for n in nodes]
    finally:  # a hung job: end each agent with its workers (its own process group), nothing left running
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    for node, out in zip(nodes, outs):
        assert node.returncode == 0, out[-4000:]
    return ckpt_dir


def uninterrupted_run(ckpt_dir: str) -> None:
    """``two_node_run``'s recipe without a fault, on two gloo ranks (one rank's process each, as
    torchrun's): the curve a restarted job must end on."""
    from megamoe.recipe import load_train_recipe
    from megamoe.training.entry import run_training

    _, config, *overrides = run_args(Path(ckpt_dir), "checkpoint.async_save=true")
    run_training(load_train_recipe(config, overrides))


def test_killed_rank_restarts_and_ends_on_the_uninterrupted_curve(pool, tmp_path):
    from megamoe.checkpoint.dcp import latest_checkpoint, read_meta

    pool(2).run(uninterrupted_run, str(tmp_path / "whole"))
    reference = losses(tmp_path / "whole")
    run = two_node_run(tmp_path, "killed", "kill", 5)  # rank 1 dies before step 5 (checkpoint at 4)
    assert (tmp_path / "kill.done").exists()
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert losses(run) == reference  # bitwise: the restarted job resumed from step 4 exactly
    assert read_meta(latest_checkpoint(run))["step"] == STEPS and not list(run.glob("*.tmp"))


DIE_IN_ASYNC_WRITE = """
import os, signal, sys
import torch.distributed.checkpoint.filesystem as fs
from megamoe.checkpoint import dcp as checkpoint
real_write, real_save, saves = fs._write_item, checkpoint.save_checkpoint, []
def counting_save(*a, **k):
    saves.append(1)
    return real_save(*a, **k)
def dying_write(*a, **k):
    if len(saves) == 2:  # the second save's writer thread: the process dies mid-write
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(*a, **k)
fs._write_item, checkpoint.save_checkpoint = dying_write, counting_save
sys.argv = ["megamoe-pretrain", *sys.argv[1:]]
from megamoe.commands.pretrain import cli
cli()
"""


def test_killed_async_save_leaves_the_previous_latest(tmp_path):
    from megamoe.checkpoint.dcp import latest_checkpoint

    run = tmp_path / "run"
    args = run_args(run, "checkpoint.async_save=true")
    died = subprocess.run([sys.executable, "-c", DIE_IN_ASYNC_WRITE, *args], env=env(), capture_output=True,
                          text=True, timeout=300)
    assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
    assert latest_checkpoint(run) == run / "step_00000002" and (run / "step_00000004.tmp").is_dir()
    done = subprocess.run([sys.executable, str(REPO / "tools/pretrain.py"), *args], env=env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "step_00000002 at step 2" in done.stderr
    assert latest_checkpoint(run) == run / f"step_{STEPS:08d}" and not list(run.glob("*.tmp"))


def test_async_save_writes_the_state_of_its_step(tmp_path):
    """Training changes the live tensors while the writer thread runs: the checkpoint holds the
    values at the save, and is not ``latest`` before ``wait()``."""
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.checkpoint.dcp import latest_checkpoint, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    at_save = model.weight.detach().clone()
    pending = save_checkpoint(tmp_path, 1, ParallelGroups(), [model], asynchronous=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert latest_checkpoint(tmp_path) is None
    assert pending.wait() == tmp_path / "step_00000001" == latest_checkpoint(tmp_path)
    fresh = torch.nn.Linear(4, 4)
    load_checkpoint(tmp_path / "step_00000001", ParallelGroups(), [fresh])
    assert torch.equal(fresh.weight, at_save)


def test_hung_rank_ends_the_run_with_one_line_naming_step_and_group(tmp_path):
    script = tmp_path / "faulty_pretrain.py"
    script.write_text(FAULTY_PRETRAIN)
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3", str(script),
           *run_args(tmp_path / "run", "train.collective_timeout_s=4")]
    out = subprocess.run(cmd, env=fault_env(tmp_path, "hang", 3), capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and (tmp_path / "hang.done").exists()
    err = next(logs.rglob("attempt_0/0/stderr.log")).read_text()
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("error: step 3: a collective in token count (group dp_cp) failed on rank 0 "
                               "within train.collective_timeout_s=4: "), lines[0]
    assert lines[0].endswith("a peer rank is hung or gone")
