"""Checkpoints: bitwise resume after kill -9, atomic saves, resharding, safe loading."""
from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megamoe.core.errors import CheckpointError
from tests.dist import free_port

REPO = Path(__file__).resolve().parent.parent
STEPS = 12


def pretrain_cmd(ckpt_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "tools/pretrain.py"), "--config", "tiny_train", f"checkpoint.dir={ckpt_dir}",
            f"train.steps={STEPS}", "checkpoint.save_interval=3", "checkpoint.keep_last=2", "logging.progress=false",
            "model.hidden_size=32", "data.seq_len=32", *extra]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


def losses(ckpt_dir: Path) -> dict[int, float]:
    """Loss by step from metrics.jsonl; a resumed run's lines replace the killed run's."""
    out = {}
    for line in (ckpt_dir / "tb" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    d = tmp_path_factory.mktemp("full") / "ckpt"
    subprocess.run(pretrain_cmd(d), check=True, env=env(), capture_output=True)
    return losses(d)


def test_kill9_then_resume_is_bitwise(tmp_path, uninterrupted):
    d = tmp_path / "ckpt"
    kill_at = random.Random(os.getpid()).randint(4, STEPS - 2)
    log = tmp_path / "killed_run.log"
    proc = subprocess.Popen(pretrain_cmd(d), env=env(), stdout=subprocess.DEVNULL, stderr=log.open("w"))
    metrics = d / "tb" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_at:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {log.read_text()[-2000:]}"
    subprocess.run(pretrain_cmd(d), check=True, env=env(), capture_output=True)
    resumed = losses(d)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == uninterrupted  # bitwise: JSON floats round-trip exactly


KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys
    from megamoe.checkpoint import dcp as checkpoint
    calls = []
    real = checkpoint._finalize
    def dying_finalize(tmp, final, root):
        calls.append(final)
        if len(calls) == 2:  # the second save dies after writing, before it is made visible
            os.kill(os.getpid(), signal.SIGKILL)
        real(tmp, final, root)
    checkpoint._finalize = dying_finalize
    sys.argv = sys.argv[1:]
    exec(open(sys.argv[0]).read(), {"__name__": "__main__"})
""")


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    from megamoe.checkpoint.dcp import latest_checkpoint, read_meta

    d = tmp_path / "ckpt"
    cmd = pretrain_cmd(d)
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, *cmd[1:]], env=env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert (d / "step_00000006.tmp").is_dir()  # the half-finished save
    latest = latest_checkpoint(d)
    assert latest == d / "step_00000003" and read_meta(latest)["step"] == 3
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stderr and "step_00000003" in done.stderr
    assert not list(d.glob("*.tmp"))  # stale temporaries are cleaned up
    assert latest_checkpoint(d).name == f"step_{STEPS:08d}"


def test_malicious_metadata_is_refused(tmp_path):
    from megamoe.checkpoint.dcp import SafeFileSystemReader

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not marker.exists()


def test_bad_checkpoint_dirs(tmp_path):
    from megamoe.checkpoint.dcp import read_meta

    with pytest.raises(CheckpointError, match="meta.json missing"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="meta.json: invalid JSON"):
        read_meta(tmp_path)


def reshard_case(save_dir: str, tp: int, dp_zero: bool) -> dict:
    """Train 3 steps at this layout and save; return the gathered full weights."""
    from megamoe.core.config import ParallelConfig
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer
    from megamoe.model.weights import full_state_dict
    from tests.test_trainer_parity import tiny_recipe

    recipe = tiny_recipe(ParallelConfig(tp=tp), steps=3)
    recipe.checkpoint.dir = save_dir
    recipe.optim.zero1 = dp_zero
    trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
    trainer.fit(save_dir + "/tb")
    full = full_state_dict(trainer.chunks[0], trainer.groups)
    return {"weights": full, "trainable": sorted(n for n, p in trainer.chunks[0].named_parameters() if p.requires_grad)}


def load_case(ckpt: str, tp: int) -> dict:
    from megamoe.core.config import ParallelConfig
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.checkpoint.dcp import load_checkpoint
    from megamoe.training.trainer import Trainer
    from megamoe.model.weights import full_state_dict
    from tests.test_trainer_parity import tiny_recipe

    trainer = Trainer(tiny_recipe(ParallelConfig(tp=tp), steps=6), SyntheticDataset(64, 16, seed=3))
    state = load_checkpoint(ckpt, trainer.groups, trainer.chunks, trainer.optimizer)
    weights = full_state_dict(trainer.chunks[0], trainer.groups)
    moments = {n: s["exp_avg_sq"].clone() for n, (p, s) in trainer.optimizer.owned_states().items()}
    return {"state": state, "weights": weights, "owned": sorted(moments), "n_moments": len(moments)}


def test_reshard_tp2_to_dp2(pool, tmp_path):
    """Saved at TP=2 (DP=1), loaded at TP=1 x DP=2 with ZeRO-1: same weights on every rank
    (the MoE layers' aux-loss-free expert biases, moved by the 3 steps, included), the
    optimizer state split between the ranks and complete."""
    out = pool(2).run(reshard_case, str(tmp_path), 2, True)[0]
    saved = out["weights"]
    biases = {n: t for n, t in saved.items() if n.endswith("router.expert_bias")}
    assert len(biases) == 3 and all(t.dtype == torch.float32 and t.abs().sum() > 0 for t in biases.values())
    ckpt = str(tmp_path / "step_00000003")
    dp2 = pool(2).run(load_case, ckpt, 1)
    for rank_result in dp2:
        assert rank_result["state"]["step"] == 3
        for name, full in saved.items():
            assert torch.equal(rank_result["weights"][name], full), name
    # ZeRO-1 at DP=2: each rank owns a disjoint part of the optimizer state, all of it loaded
    owned = [set(r["owned"]) for r in dp2]
    assert owned[0].isdisjoint(owned[1]) and sorted(owned[0] | owned[1]) == out["trainable"]
