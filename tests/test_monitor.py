"""The monitor's TensorBoard events read back; the NaN/Inf guard skips, then saves and stops."""
from __future__ import annotations

import pytest
import torch

from megamoe.config import ParallelConfig
from tests.test_trainer_parity import tiny_recipe


def monitored_run(log_dir: str, steps: int) -> list[float]:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer

    recipe = tiny_recipe(ParallelConfig(tp=2, sequence_parallel=True), steps=steps)
    recipe.logging.latency_histograms = True
    recipe.logging.heatmap_interval = 2
    trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
    return [h["loss"] for h in trainer.fit(log_dir)]


def test_tensorboard_scalars_and_latency_histograms(pool, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pool(2).run(monitored_run, str(tmp_path), 4)
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_rss_gib", "seconds"):
        assert f"train/{name}" in tags["scalars"], tags["scalars"]
        assert [e.step for e in acc.Scalars(f"train/{name}")] == [1, 2, 3, 4]
    # sequence parallelism all-gathers the sequence before every column-parallel linear
    hist = [t for t in tags["histograms"] if t.startswith("latency_ms/all_gather/layer")]
    assert {"latency_ms/all_gather/layer0", "latency_ms/all_gather/layer3"} <= set(hist), hist
    h = acc.Histograms("latency_ms/all_gather/layer0")[-1].histogram_value
    assert h.num > 0 and h.min >= 0


def nan_run(ckpt_dir: str) -> dict:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import NonFiniteStop, Trainer

    recipe = tiny_recipe(ParallelConfig(), steps=20, nan_max_consecutive=3)
    recipe.optim.lr, recipe.optim.warmup_steps, recipe.optim.clip_grad = 1e30, 0, 0.0
    recipe.checkpoint.dir = ckpt_dir
    trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
    snapshots = []
    trainer.after_step_hooks.append(lambda t: snapshots.append(t.step))
    try:
        trainer.fit(ckpt_dir + "/tb")
    except NonFiniteStop as e:
        return {"message": str(e), "step": trainer.step, "skipped": trainer.skipped, "updates": snapshots,
                "weight_finite": [bool(torch.isfinite(p).all()) for p in trainer.optimizer.params][:3]}
    return {"message": None}


def test_nonfinite_steps_are_skipped_then_saved_and_stopped(pool, tmp_path):
    from megamoe.training.checkpoint import latest_checkpoint, read_meta

    out = pool(1).run(nan_run, str(tmp_path))[0]
    assert out["message"] and "3 consecutive steps had a non-finite gradient norm" in out["message"]
    assert out["skipped"] == 3 and out["step"] == out["updates"][-1] + 3  # updates stopped, steps went on
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and read_meta(ckpt)["trainer_state"]["skipped_steps"] == 3
