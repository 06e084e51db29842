"""Resume guards: a run continues a checkpoint only with the settings it was written with.

A checkpoint's meta.json records the model, the LoRA settings and a ``run`` section: the
settings that change the maths of training whatever the parallel layout (data, the global
batch, seed, precision, fp8, optimizer). Resuming compares them all, loading base weights
(``checkpoint.load``) compares the model; any difference is refused in one line naming every
changed field, unless ``checkpoint.allow_changes`` lists it (or a section above it), and each
allowed change is logged. The parallel layout, ``train.steps`` (extending a run), where frozen
experts are kept (``model.moe.expert_store``) and the logging/checkpoint sections may change freely.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from megamoe.core.errors import CheckpointError
from megamoe.core.config_io import config_to_dict

log = logging.getLogger(__name__)

# the train settings that change the maths (steps may grow; micro-batching and the device do not)
TRAIN_KEYS = ("global_batch_size", "seed", "precision", "fp8", "indexer", "mtp_loss_weight")
DATA_SKIP = ("num_workers",)


class CheckpointMismatch(CheckpointError):
    """The run's settings differ from the checkpoint's: the user's to resolve (no fallback)."""


def run_record(recipe) -> dict:
    """The parallel-independent settings a checkpoint records besides model and LoRA."""
    data = {k: v for k, v in config_to_dict(recipe.data).items() if k not in DATA_SKIP}
    train = config_to_dict(recipe.train)
    return {"data": data, "train": {k: train[k] for k in TRAIN_KEYS if k in train}, "optim": config_to_dict(recipe.optim),
            "eval": {"split": recipe.eval.split}}  # a held-out split changes the training samples


def _plain(value):
    """As JSON reads it back (tuples -> lists, so a saved and a live value compare equal)."""
    return json.loads(json.dumps(value))


def changed_fields(saved, now, prefix: str) -> list[tuple[str, object, object]]:
    """(dotted field, saved value, current value) for every leaf that differs. A field the
    checkpoint does not record (written before the field existed) is not compared."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(saved) & set(now)):
            out += changed_fields(saved[key], now[key], f"{prefix}.{key}")
        return out
    return [] if saved == now else [(prefix, saved, now)]


def _show(value) -> str:
    return "{...}" if isinstance(value, dict) else json.dumps(value)


# where frozen experts are kept changes no value: free to change like the parallel layout
FREE = ("model.moe.expert_store",)


def _allowed(field: str, allow) -> bool:
    return any(field == a or field.startswith(a + ".") for a in allow)


def check_unchanged(path: Path, meta: dict, now: dict, allow=(), what: str = "resume") -> None:
    """Refuse ``now`` (section -> plain config) if it differs from what ``meta`` recorded.
    ``meta`` keeps ``model`` and ``lora`` at its top level and the rest under ``run``."""
    saved = {**meta.get("run", {}), "model": meta.get("model"), "lora": meta.get("lora")}
    changes = []
    for section, value in now.items():
        old = saved.get(section)
        if old is None and section != "lora":  # no lora: a full-model run
            continue  # not recorded (an older or converted checkpoint)
        changes += [c for c in changed_fields(old, _plain(value), section) if not _allowed(c[0], FREE)]
    refused = [c for c in changes if not _allowed(c[0], allow)]
    for field, old, new in changes:
        if not _allowed(field, allow):
            continue
        log.warning("%s: %s changed from %s to %s (allowed by checkpoint.allow_changes)", path, field, old, new)
    if refused:
        listed = "; ".join(f"{f} {_show(o)} -> {_show(n)}" for f, o, n in refused)
        raise CheckpointMismatch(f"{path}: cannot {what}, the run differs from the checkpoint in {listed} "
                              f"(revert, or accept with checkpoint.allow_changes=[{','.join(f for f, _, _ in refused)}])")
