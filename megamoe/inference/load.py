"""What generate and verify accept as a model: an HF directory (config.json), a megamoe
checkpoint (converted or from training, or a run's directory), or a LoRA fine-tune's
adapter-only checkpoint, whose base weights come from the path its meta.json records."""
from __future__ import annotations

from pathlib import Path

from megamoe.core.errors import CheckpointError


def checkpoint_path(path: str | Path) -> Path:
    """A checkpoint folder itself, or the latest checkpoint of a run's directory."""
    from megamoe.checkpoint.dcp import latest_checkpoint

    path = Path(path)
    if not (path / "meta.json").is_file() and latest_checkpoint(path) is not None:
        return latest_checkpoint(path)
    return path


BASE_HELP = "for a LoRA checkpoint: its base weights, instead of the folder its meta.json records"


def lora_base(path: Path, meta: dict, override: str | Path | None = None) -> Path:
    """The base weights an adapter-only checkpoint was trained on (``lora_base`` in its meta,
    or ``override``, e.g. after the base was moved)."""
    if override is not None:
        found = checkpoint_path(override)
        if not (found / "meta.json").is_file():
            raise CheckpointError(f"--base {override}: not a megamoe checkpoint (meta.json missing)")
        return found
    base = meta.get("lora_base")
    if not base:
        raise CheckpointError(f"{path}/meta.json: a LoRA checkpoint without 'lora_base' (the run had no "
                              f"checkpoint.load), so there are no base weights to put the adapters on")
    found = checkpoint_path(base)  # a checkpoint, or a run's folder (its latest checkpoint)
    if not (found / "meta.json").is_file():
        raise CheckpointError(f"{path}/meta.json: lora_base {base} is not a megamoe checkpoint (moved or deleted? "
                              f"--base names where it is now)")
    return found


def hf_origin_of(path: str | Path, base: str | Path | None = None) -> dict | None:
    """The HF origin a checkpoint records (a LoRA checkpoint's, else its base's), without loading weights."""
    from megamoe.checkpoint.dcp import read_meta

    path = checkpoint_path(path)
    meta = read_meta(path)
    if meta.get("hf") or not meta.get("lora"):
        return meta.get("hf")
    return read_meta(lora_base(path, meta, base)).get("hf")


def load_model(path: str | Path, merge: bool = True, base: str | Path | None = None, expert_store=None,
               keep_fp8: bool = False):
    """The model in ``path`` on CPU, in eval mode, with ``hf_origin`` set when known. A LoRA
    checkpoint gives its base (``base``, else the one its meta.json records) with the adapters
    applied, merged into the weights unless ``merge=False``. ``expert_store`` (an enabled
    ``ExpertStoreConfig``): the routed experts stay in the weights' converted checkpoint and
    come in when routed to (``megamoe.expert_store``; adapters then stay unmerged). ``keep_fp8``: an FP8
    HF directory's weights stay e4m3 (``from_hf(keep_fp8=True)``; a converted checkpoint holds
    them as it was imported)."""
    from megamoe.convert import build_model, from_hf
    from megamoe.core.config_io import config_from_dict
    from megamoe.checkpoint.dcp import load_checkpoint, read_meta

    tiered = expert_store is not None and expert_store.enabled
    if (Path(path) / "config.json").is_file():
        if tiered:
            raise CheckpointError(f"{path}: tiered experts read a converted checkpoint: megamoe-convert import-hf "
                                  f"{path} OUT first")
        return from_hf(path, keep_fp8=keep_fp8)
    path = checkpoint_path(path)
    meta = read_meta(path)
    if "model" not in meta:
        raise CheckpointError(f"{path}/meta.json: no model config (written by an older megamoe?)")
    config = config_from_dict(meta["model"])
    if not tiered and (meta.get("hf") or {}).get("experts_in_hf"):
        raise CheckpointError(f"{path}: imported with --experts-in-hf, its routed experts are in {meta['hf']['path']}: "
                              "give --expert-budget (tiered experts read them from there)")
    if tiered and config.moe is not None:
        config.moe.expert_store = expert_store
    model = build_model(config)
    weights = path
    if not meta.get("lora"):
        load_checkpoint(path, model.groups, [model], load_rng=False)
    else:
        from megamoe.lora import LoRAConfig, apply_lora, is_adapter_name
        from megamoe.lora import merge as merge_lora

        weights = lora_base(path, meta, base)
        base_meta = load_checkpoint(weights, model.groups, [model], load_rng=False)
        meta["hf"] = meta.get("hf") or base_meta.get("hf")
        apply_lora(model, config_from_dict(meta["lora"], LoRAConfig))
        load_checkpoint(path, model.groups, [model], load_rng=False, select=is_adapter_name)
        if merge and not tiered:
            merge_lora(model)
    if tiered:
        from megamoe.expert_store import open_expert_store

        model.expert_store = open_expert_store([model], model.groups, weights, config.moe.placement)
    if meta.get("hf"):
        model.hf_origin = meta["hf"]
    return model.eval()
