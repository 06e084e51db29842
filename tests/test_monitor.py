"""The monitor's TensorBoard events read back; the NaN/Inf guard skips, then saves and stops."""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import ParallelConfig
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
    # the same figure as a PNG beside the events, with what it shows in its text chunks
    pngs = sorted((tmp_path / "expert_load").glob("*.png"))
    assert [p.name for p in pngs] == ["step_00000002.png", "step_00000004.png"]
    check_expert_figure(pngs[-1], layers=[0, 2, 3], experts=4, ep=2)
    # and its counts as the load file the expert planner reads (megamoe-plan experts --load)
    from megamoe.core.placement import read_load

    load = read_load(tmp_path / "expert_load" / "step_00000004.json")
    assert sorted(load) == [0, 2, 3] and all(len(v) == 4 and sum(v) > 0 for v in load.values())


def check_expert_figure(path, layers: list[int], experts: int, ep: int) -> None:
    """The figure's metadata: axes, colour scale from 0 to the hottest share, hottest experts
    sorted; the hottest cell is drawn in the scale's top colour."""
    import json

    from PIL import Image

    from megamoe.training.figures import RAMP

    img = Image.open(path)
    meta = img.text
    assert meta["megamoe:xlabel"] == "expert" and meta["megamoe:ylabel"] == "layer"
    assert json.loads(meta["megamoe:layers"]) == layers and meta["megamoe:ep_ranks"] == str(ep)
    assert float(meta["megamoe:even_share"]) == pytest.approx(1 / experts, abs=1e-6)
    hot = json.loads(meta["megamoe:hottest"])
    assert len(hot) == 3 and [h["share"] for h in hot] == sorted((h["share"] for h in hot), reverse=True)
    assert 1 / experts <= hot[0]["share"] <= 1
    assert meta["megamoe:colorbar"] == f"share of the layer's routed tokens, 0 to {hot[0]['share']:.6f}"
    assert meta["Title"].startswith("expert load at step")
    assert img.width >= 460 and img.height > 100
    # the hottest cell's centre (cells start at x=60, y=40; sizes as the figure computes them)
    cw, ch = max(3, min(24, 960 // experts)), max(6, min(24, 480 // len(layers)))
    r, c = layers.index(hot[0]["layer"]), hot[0]["slot"]
    assert img.convert("RGB").getpixel((60 + c * cw + cw // 2, 40 + r * ch + ch // 2)) == tuple(int(v) for v in RAMP[-1])


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
    from megamoe.checkpoint.dcp import latest_checkpoint, read_meta

    out = pool(1).run(nan_run, str(tmp_path))[0]
    assert out["message"] and "3 consecutive steps had a non-finite gradient norm" in out["message"]
    assert out["skipped"] == 3 and out["step"] == out["updates"][-1] + 3  # updates stopped, steps went on
    # saves pause during the streak and the stop writes nothing: latest is the last updated step
    ckpt = latest_checkpoint(tmp_path)
    state = read_meta(ckpt)["trainer_state"]
    assert state["step"] == out["updates"][-1] and state["skipped_steps"] == 0 and f"{ckpt} stays latest" in out["message"]


# ---- Weights & Biases -------------------------------------------------------------------------------

def wandb_run(log_dir: str) -> None:
    import os

    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.config import WandbConfig
    from megamoe.training.trainer import Trainer

    os.environ.update(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    recipe = tiny_recipe(ParallelConfig(), steps=3)
    recipe.logging.heatmap_interval = 2
    recipe.logging.wandb = WandbConfig(project="megamoe-test", name="tiny", mode="offline", dir=log_dir + "/wandb")
    Trainer(recipe, SyntheticDataset(64, 16, seed=3)).fit(log_dir)


def wandb_records(path):
    """The records of a W&B transaction log (.wandb: a header, then LevelDB-log records in 32 KiB
    blocks, each chunk with a 7-byte header: CRC, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_records_the_tensorboard_scalars(pool, tmp_path):
    """``logging.wandb`` (offline): every TensorBoard scalar at every step, the same value, and the
    expert-load figure, in the W&B run; the recipe is the run's config."""
    pytest.importorskip("wandb", reason="optional extra: pip install megamoe[wandb]")
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pool(1).run(wandb_run, str(tmp_path))
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tb = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    (log,) = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    wb, images, config = {}, set(), None
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = record.history.step.num
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            media = {k[:-len("/_type")] for k, v in items.items() if k.endswith("/_type")}  # an image's fields
            images |= {(k, step) for k in media if items[k + "/_type"] == "image-file"}
            wb.update({(k, step): v for k, v in items.items() if isinstance(v, (int, float)) and not k.startswith("_")
                       and not any(k.startswith(m + "/") for m in media)})
        elif kind in ("run", "config"):  # the run's config comes with the run record (or a later update)
            update = (record.run.config if kind == "run" else record.config).update
            config = {**(config or {}), **{item.key: json.loads(item.value_json) for item in update}}
    assert len(tb) > 30 and set(tb) == set(wb), sorted(set(tb) ^ set(wb))[:10]
    assert all(wb[k] == pytest.approx(tb[k], rel=1e-6, abs=1e-12) for k in tb)
    assert images == {("moe/expert_load", 2), ("moe/expert_load", 3)}
    plain = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
    assert plain["model"]["layout"] == "GeAd|SeGe" and plain["train"]["steps"] == 3, config
