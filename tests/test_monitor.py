"""The monitor's TensorBoard events read back; the NaN/Inf guard skips, then saves and stops."""
from __future__ import annotations

import pytest
import torch

from megamoe.config import ParallelConfig
from tests.test_trainer_parity import tiny_recipe


def monitored_run(log_dir: str, steps: int) -> list[float]:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer

    # TP=2 with SP all-gathers the sequence; EP=2 (on the same two ranks) exchanges tokens all-to-all
    recipe = tiny_recipe(ParallelConfig(tp=2, sequence_parallel=True, ep=2, etp=1), steps=steps)
    recipe.logging.latency_interval = 1
    recipe.logging.heatmap_interval = 2
    trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
    return [h["loss"] for h in trainer.fit(log_dir)]


def test_tensorboard_scalars_heatmaps_and_latency_histograms(pool, tmp_path):
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
    # the MoE layers' token exchange
    a2a = [t for t in tags["histograms"] if t.startswith("latency_ms/all_to_all/layer")]
    assert {"latency_ms/all_to_all/layer0", "latency_ms/all_to_all/layer2", "latency_ms/all_to_all/layer3"} <= set(a2a), a2a
    assert acc.Histograms("latency_ms/all_to_all/layer0")[-1].histogram_value.num > 0
    # per-layer expert metrics, and the layers x experts load heatmap every heatmap_interval steps
    for name in ("imbalance", "router_entropy", "dropped_tokens"):
        assert any(t.startswith(f"moe/{name}") for t in tags["scalars"]), tags["scalars"]
    assert "moe/expert_load" in tags["images"], tags["images"]
    images = acc.Images("moe/expert_load")
    assert [e.step for e in images] == [2, 4]
    assert images[-1].height > 0 and images[-1].width > 0
    assert images[-1].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"


def nan_run(ckpt_dir: str) -> dict:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import NonFiniteStop, Trainer

    recipe = tiny_recipe(ParallelConfig(), steps=20, nan_max_consecutive=3)
    recipe.optim.lr, recipe.optim.warmup_steps, recipe.optim.clip_grad = 1e30, 0, 0.0
    recipe.checkpoint.dir, recipe.checkpoint.save_interval = ckpt_dir, 1
    trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
    snapshots = []
    trainer.after_step_hooks.append(lambda t: snapshots.append(t.step))
    try:
        trainer.fit(ckpt_dir + "/tb")
    except NonFiniteStop as e:
        return {"message": str(e), "step": trainer.step, "skipped": trainer.skipped, "updates": snapshots,
                "weight_finite": [bool(torch.isfinite(p).all()) for p in trainer.optimizer.params][:3]}
    return {"message": None}


def test_nonfinite_steps_are_skipped_then_stopped_keeping_the_last_finite_checkpoint(pool, tmp_path):
    from megamoe.training.checkpoint import latest_checkpoint, read_meta

    out = pool(1).run(nan_run, str(tmp_path))[0]
    assert out["message"] and "3 consecutive steps had a non-finite gradient norm" in out["message"]
    assert out["skipped"] == 3 and out["step"] == out["updates"][-1] + 3  # updates stopped, steps went on
    # saves pause during the streak and the stop writes nothing: latest is the last updated step
    ckpt = latest_checkpoint(tmp_path)
    state = read_meta(ckpt)["trainer_state"]
    assert state["step"] == out["updates"][-1] and state["skipped_steps"] == 0 and f"{ckpt} stays latest" in out["message"]
