"""What training shows: TensorBoard scalars, expert-load heatmaps, communication-latency
histograms, a metrics JSONL file and a console progress bar with ETA.

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

from megamoe.memory import peak_rss_mib, rss_mib
from megamoe.training.config import LoggingConfig

log = logging.getLogger(__name__)

# a perceptually ordered ramp (dark blue -> teal -> yellow) for heatmaps
_RAMP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)


def heatmap_image(values: np.ndarray, cell: int = 8) -> np.ndarray:
    """[rows, cols] non-negative values -> [rows*cell, cols*cell, 3] uint8 (max value = yellow)."""
    v = np.asarray(values, dtype=np.float64)
    top = v.max() if v.size and v.max() > 0 else 1.0
    x = np.clip(v / top, 0, 1) * (len(_RAMP) - 1)
    lo = np.floor(x).astype(int).clip(0, len(_RAMP) - 2)
    frac = (x - lo)[..., None]
    rgb = _RAMP[lo] * (1 - frac) + _RAMP[lo + 1] * frac
    return np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1).astype(np.uint8)


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
    """TensorBoard + JSONL + progress bar on the logging rank; a no-op elsewhere."""

    def __init__(self, log_dir: str | Path, cfg: LoggingConfig, total_steps: int, start_step: int,
                 enabled: bool):
        self.cfg, self.enabled, self.total = cfg, enabled, total_steps
        self.dir = Path(log_dir)
        self.writer = self.bar = self.jsonl = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.dir), purge_step=start_step if start_step else None)
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
                 layer_scalars: dict[str, float] | None = None) -> None:
        """``step`` is 1-based (the number of optimizer steps done). The JSONL line and the
        progress bar follow every step; the events only steps where ``logs(step)``.
        ``latencies``: the communication samples (see ``comm_series``), on logging steps."""
        if not self.enabled:
            return
        by_tag, by_group = comm_series(latencies or {})
        summary = comm_summary(by_group)
        self.jsonl.write(json.dumps({"step": step, **scalars, **summary}) + "\n")
        self.jsonl.flush()
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{scalars.get('loss', float('nan')):.4f}",
                                 lr=f"{scalars.get('lr', 0):.2e}")
        if not self.logs(step):
            return
        for k, v in scalars.items():
            self.writer.add_scalar(f"train/{k}", v, step)
        for k, v in {**(layer_scalars or {}), **summary}.items():
            self.writer.add_scalar(k, v, step)
        for tag, ms in by_tag.items():  # which layer or phase
            self.writer.add_histogram(f"latency_ms/{tag}", np.asarray(ms), step)
        for tag, samples in by_group.items():  # which group and message size
            self.writer.add_histogram(f"comm_ms/{tag}", np.asarray([s for s, _ in samples]), step)
        if expert_load and (step % self.cfg.heatmap_interval == 0 or step == self.total):
            layers = sorted(expert_load)
            grid = np.stack([expert_load[i].detach().double().cpu().numpy() for i in layers])
            self.writer.add_image("moe/expert_load", heatmap_image(grid), step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
