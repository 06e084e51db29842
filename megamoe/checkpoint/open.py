"""Opening a megamoe checkpoint: the one place that finds it, reads its ``meta.json`` and its
model config, and follows a LoRA checkpoint to its base weights.

A path is a checkpoint folder (``meta.json``: converted, or a training step), or a run's folder
(its latest complete checkpoint). An adapter-only LoRA checkpoint records the base it was
trained on (``lora_base``), itself a checkpoint or a run's folder; ``base(override)`` names
another where the base has moved. Opening reads no weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megamoe.checkpoint.dcp import check_stamps, latest_checkpoint, read_meta
from megamoe.core.config import ModelConfig
from megamoe.core.config_io import config_from_dict
from megamoe.core.errors import CheckpointError


def checkpoint_path(path: str | Path) -> Path:
    """A checkpoint folder itself, or the latest checkpoint of a run's directory."""
    path = Path(path)
    if not (path / "meta.json").is_file() and latest_checkpoint(path) is not None:
        return latest_checkpoint(path)
    return path


@dataclass
class Checkpoint:
    """An opened checkpoint: where it is and its ``meta.json``."""

    path: Path
    meta: dict

    @property
    def config(self) -> ModelConfig:
        """The model it holds (``meta.json``'s ``model``), checked to fit the weights on disk."""
        if "model" not in self.meta:
            raise CheckpointError(f"{self.path}/meta.json: no model config (written by an older megamoe?)")
        cfg = config_from_dict(self.meta["model"])
        self.check_size(cfg)
        return cfg

    def check_size(self, cfg: ModelConfig) -> None:
        """Before anything is allocated: the model ``meta.json`` describes has no more parameters than
        the weights on disk have bytes (FP8 is one byte a parameter: nothing smaller is stored), so a
        hostile or broken ``hidden_size``/``vocab_size`` is one line, not an allocation."""
        from megamoe.model.build import build_model
        from megamoe.model.params import count_parameters

        try:
            cfg.validate()
            params = count_parameters(build_model(cfg, device="meta")).total
        except (ValueError, TypeError, RuntimeError, OverflowError) as e:
            raise CheckpointError(f"{self.path}/meta.json: its model section does not build "
                                  f"({' '.join(str(e).split())[:200]})") from None
        folders = self.weight_folders()
        held = sum(weight_bytes(p) for p in folders or ())
        if folders is not None and params > held:
            raise CheckpointError(f"{self.path}/meta.json: the model it describes (hidden_size {cfg.hidden_size}, "
                                  f"vocab_size {cfg.vocab_size}) has {params:,} parameters, more than the {held:,} "
                                  f"bytes of weights the checkpoint holds (truncated weight files, or a model "
                                  f"section that is not theirs)")

    def weight_folders(self) -> list[Path] | None:
        """Where the model's weights are: this folder, a LoRA checkpoint's base, the HF folder of
        routed experts left there (``--experts-in-hf``); None when one is not where meta.json says
        (moved: ``--base`` names it, and loading checks it)."""
        folders = [self.path]
        if self.is_lora:
            base = self.meta.get("lora_base")
            folders.append(checkpoint_path(base) if isinstance(base, str) else None)
        hf = self.meta.get("hf") or {}
        if hf.get("experts_in_hf"):
            folders.append(Path(hf["path"]) if isinstance(hf.get("path"), str) else None)
        return None if any(f is None or not f.is_dir() for f in folders) else folders

    @property
    def is_lora(self) -> bool:
        """An adapter-only LoRA checkpoint (its base weights are elsewhere)."""
        return bool(self.meta.get("lora"))

    def base(self, override: str | Path | None = None) -> Checkpoint:
        """The base weights an adapter-only checkpoint was trained on (``lora_base`` in its meta,
        or ``override``, e.g. after the base was moved)."""
        if override is not None:
            found = checkpoint_path(override)
            if not (found / "meta.json").is_file():
                raise CheckpointError(f"--base {override}: not a megamoe checkpoint (meta.json missing)")
            return open_checkpoint(found)
        base = self.meta.get("lora_base")
        if not base:
            raise CheckpointError(f"{self.path}/meta.json: a LoRA checkpoint without 'lora_base' (the run had no "
                                  f"checkpoint.load), so there are no base weights to put the adapters on")
        found = checkpoint_path(base)
        if not (found / "meta.json").is_file():
            raise CheckpointError(f"{self.path}/meta.json: lora_base {base} is not a megamoe checkpoint (moved or "
                                  f"deleted? --base names where it is now)")
        return open_checkpoint(found)

    def hf_origin(self, base: str | Path | None = None) -> dict | None:
        """The HF origin it records (a LoRA checkpoint's, else its base's)."""
        if self.meta.get("hf") or not self.is_lora:
            return self.meta.get("hf")
        return self.base(base).meta.get("hf")


def weight_bytes(folder: Path) -> int:
    """Bytes of the weight files directly in ``folder`` (safetensors shards, DCP files)."""
    files = [*folder.glob("*.safetensors"), *folder.glob("*.distcp")] if folder.is_dir() else []
    return sum(f.stat().st_size for f in files if f.is_file())


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path`` (a run's folder: its latest), ``meta.json`` read and checked."""
    path = checkpoint_path(path)
    meta = read_meta(path)
    check_stamps(path, meta)
    return Checkpoint(path, meta)
