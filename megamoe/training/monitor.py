"""What training shows: TensorBoard (and, with ``logging.wandb``, Weights & Biases) scalars,
the expert-load figure, communication-latency histograms, validation loss, a metrics JSONL file
and a console progress bar with ETA.

Only the logging rank (global rank 0) writes; values it needs from other ranks are reduced
by the trainer before ``log_step``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from megamoe.diagnostics.memory import peak_rss_mib, rss_mib
from megamoe.training.config import LoggingConfig

log = logging.getLogger(__name__)

def memory_gib() -> dict[str, float]:
    """Current and peak host RSS, and peak CUDA memory when on GPU."""
    out = {"peak_rss_gib": peak_rss_mib() / 1024, "rss_gib": rss_mib() / 1024}
    if torch.cuda.is_available():
        out["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def comm_series(latencies: dict[str, list[tuple[float, int]]]) -> tuple[dict, dict]:
    """The recorder's samples (``comm.sample_key`` -> [(seconds, bytes)]) as histograms of
    milliseconds: by ``kind/tag`` (which layer or phase) and by ``kind/group/bucket``."""
    from megamoe.parallel.comm import split_key

    by_tag: dict[str, list[float]] = {}
    by_group: dict[str, list[tuple[float, int]]] = {}
    for key, samples in latencies.items():
        kind, group, bucket, tag = split_key(key)
        by_tag.setdefault(f"{kind}/{tag}", []).extend(s * 1e3 for s, _ in samples)
        by_group.setdefault(f"{kind}/{group}/{bucket}", []).extend((s * 1e3, n) for s, n in samples)
    return by_tag, by_group


def comm_summary(by_group: dict[str, list[tuple[float, int]]]) -> dict[str, float]:
    """Per ``kind/group`` (all size buckets, all ranks, the sampled steps since the last log):
    ``comm/<kind>/<group>/{calls,mib,p50_ms,p99_ms}``."""
    merged: dict[str, list[tuple[float, int]]] = {}
    for key, samples in by_group.items():
        merged.setdefault(key.rsplit("/", 1)[0], []).extend(samples)
    out = {}
    for key, samples in sorted(merged.items()):
        ms = np.array([s for s, _ in samples])
        out[f"comm/{key}/calls"] = float(len(samples))
        out[f"comm/{key}/mib"] = sum(n for _, n in samples) / 2**20
        out[f"comm/{key}/p50_ms"] = float(np.percentile(ms, 50))
        out[f"comm/{key}/p99_ms"] = float(np.percentile(ms, 99))
    return out


_KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def peak_tflops(cfg: LoggingConfig, device: torch.device) -> float:
    """Per-rank peak for MFU: configured, a known GPU's dense bf16 peak, or a measured fp32
    matmul rate on CPU (a rough ceiling of what this machine does)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _KNOWN_PEAK_TFLOPS.items():
            if key in name:
                return value
        return 100.0
    a = torch.randn(512, 512)
    a @ a  # warm-up
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        a @ a
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - start) / 1e12


def _trimmed(path: Path, start_step: int) -> Path:
    """``path`` without the lines of steps after ``start_step``: a run that resumes from an
    earlier checkpoint than where the last run stopped logs those steps again, once."""
    if not path.is_file():
        return path
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= start_step:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short by a kill
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)
    return path


class Monitor:
    """TensorBoard (+ W&B) + JSONL + progress bar on the logging rank; a no-op elsewhere.
    ``figure_info``: ``{"ep": ..., "placement": ...}`` for the expert-load figure;
    ``run_config``: the recipe as plain data (W&B's run config)."""

    def __init__(self, log_dir: str | Path, cfg: LoggingConfig, total_steps: int, start_step: int,
                 enabled: bool, figure_info: dict | None = None, run_config: dict | None = None):
        from megamoe.training.sinks import TensorBoardSink, WandbSink

        self.cfg, self.enabled, self.total = cfg, enabled, total_steps
        self.dir, self.figure_info = Path(log_dir), figure_info or {}
        self.sinks, self.bar, self.jsonl, self.shown = [], None, None, {}
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sinks.append(TensorBoardSink(self.dir, start_step if start_step else None))
        if cfg.wandb.enabled:
            self.sinks.append(WandbSink(cfg.wandb, self.dir, run_config))
        self.jsonl = open(_trimmed(self.dir / "metrics.jsonl", start_step), "a")
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def logs(self, step: int) -> bool:
        """Whether step ``step`` writes TensorBoard events (the same answer on every rank)."""
        return step % self.cfg.interval == 0 or step == self.total

    def log_step(self, step: int, scalars: dict[str, float],
                 latencies: dict[str, list[tuple[float, int]]] | None = None,
                 expert_load: dict[int, torch.Tensor] | None = None,
                 layer_scalars: dict[str, float] | None = None, tagged: dict[str, float] | None = None) -> None:
        """``step`` is 1-based (the number of optimizer steps done). The JSONL line and the
        progress bar follow every step; the events only steps where ``logs(step)``, except
        ``tagged`` (e.g. ``eval/loss``), which is written whenever given.
        ``latencies``: the communication samples (see ``comm_series``), on logging steps."""
        if not self.enabled:
            return
        by_tag, by_group = comm_series(latencies or {})
        summary = comm_summary(by_group)
        self.jsonl.write(json.dumps({"step": step, **scalars, **summary}) + "\n")
        self.jsonl.flush()
        self._progress(step, scalars)
        for k, v in (tagged or {}).items():
            self._scalar(k, v, step)
        if self.logs(step):
            self._events(step, scalars, {**(layer_scalars or {}), **summary}, by_tag, by_group, expert_load)
        for sink in self.sinks:
            sink.flush(step)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        for sink in self.sinks:
            sink.scalar(tag, value, step)

    def _progress(self, step: int, scalars: dict) -> None:
        if self.bar is None:
            return
        if "eval_loss" in scalars:
            self.shown["val"] = f"{scalars['eval_loss']:.4f}"
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{scalars.get('loss', float('nan')):.4f}", lr=f"{scalars.get('lr', 0):.2e}",
                             **self.shown)

    def _events(self, step, scalars, tagged, by_tag, by_group, expert_load) -> None:
        for k, v in scalars.items():
            if not k.startswith("eval_"):  # written as eval/loss, eval/ppl
                self._scalar(f"train/{k}", v, step)
        for k, v in tagged.items():
            self._scalar(k, v, step)
        for sink in self.sinks:
            for tag, ms in by_tag.items():  # which layer or phase
                sink.histogram(f"latency_ms/{tag}", np.asarray(ms), step)
            for tag, samples in by_group.items():  # which group and message size
                sink.histogram(f"comm_ms/{tag}", np.asarray([s for s, _ in samples]), step)
        if expert_load and (step % self.cfg.heatmap_interval == 0 or step == self.total):
            self._expert_figure(step, expert_load)

    def _expert_figure(self, step: int, expert_load: dict[int, torch.Tensor]) -> None:
        """The figure as an image event and as ``expert_load/step_XXXXXXXX.png`` beside the events."""
        from megamoe.core.placement import logical_load, write_json
        from megamoe.training.figures import expert_load_figure, save_png

        load = {n: t.detach().double().cpu().numpy() for n, t in expert_load.items()}
        img, meta = expert_load_figure(load, step, **self.figure_info)
        save_png(img, meta, self.dir / "expert_load" / f"step_{step:08d}.png")
        # the same counts as a load file in HF expert order: megamoe-plan experts --load FILE [--redundant N]
        write_json(self.dir / "expert_load" / f"step_{step:08d}.json",
                   logical_load({n: v.tolist() for n, v in load.items()}, self.figure_info.get("placement")))
        hwc = np.asarray(img.convert("RGB"))
        for sink in self.sinks:
            sink.image("moe/expert_load", hwc, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for sink in self.sinks:
            sink.close()
        if self.jsonl is not None:
            self.jsonl.close()
