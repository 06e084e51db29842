"""Where the monitor's values go: TensorBoard always, Weights & Biases when ``logging.wandb``
names a project. Both receive the same calls (scalars, histograms, images) under the same tags,
so a W&B run shows exactly what TensorBoard does.

W&B is imported only when enabled (``pip install megamoe[wandb]``); a missing package or a
failed ``wandb.init`` is one line naming ``logging.wandb``. A step's values are sent as one
``wandb.log(..., step=step)`` when the step is flushed.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from megamoe.core.errors import ConfigError
from megamoe.training.config import WandbConfig


class TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def histogram(self, tag: str, values: np.ndarray, step: int) -> None:
        self.writer.add_histogram(tag, values, step)

    def image(self, tag: str, hwc: np.ndarray, step: int) -> None:
        self.writer.add_image(tag, hwc, step, dataformats="HWC")

    def flush(self, step: int) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run for the training run (a new one per process start)."""

    def __init__(self, cfg: WandbConfig, log_dir: Path, run_config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.wandb.project is set but wandb is not installed (pip install "
                              "megamoe[wandb], or unset logging.wandb.project)") from None
        self.wandb, self.pending, self.step = wandb, {}, None
        folder = Path(cfg.dir) if cfg.dir else log_dir
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, group=cfg.group,
                                  tags=list(cfg.tags) or None, mode=cfg.mode, dir=str(folder), config=run_config,
                                  reinit="create_new")
        except Exception as e:  # noqa: BLE001  (wandb raises its own types: login, network, settings)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"logging.wandb: wandb.init failed ({first}); mode=offline logs without a server") from None

    def _at(self, step: int) -> dict:
        if self.step is not None and step != self.step:
            self.flush(self.step)
        self.step = step
        return self.pending

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._at(step)[tag] = value

    def histogram(self, tag: str, values: np.ndarray, step: int) -> None:
        self._at(step)[tag] = self.wandb.Histogram(np.asarray(values))

    def image(self, tag: str, hwc: np.ndarray, step: int) -> None:
        self._at(step)[tag] = self.wandb.Image(hwc)

    def flush(self, step: int) -> None:
        if self.pending:
            self.run.log(self.pending, step=self.step if self.step is not None else step)
        self.pending, self.step = {}, None

    def close(self) -> None:
        if self.step is not None:
            self.flush(self.step)
        self.run.finish()
