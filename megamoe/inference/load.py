"""What generate, verify, precision and export accept as a model, loaded by one ``load_model``:
an HF directory (config.json), a megamoe checkpoint (converted or from training, or a run's
directory: ``megamoe.checkpoint.open_checkpoint``), or a LoRA fine-tune's adapter-only
checkpoint, whose base weights come from the path its meta.json records. In one process, or
this rank's pipeline stage and shards under ``groups`` (torchrun)."""
from __future__ import annotations

from pathlib import Path

from megamoe.checkpoint.dcp import load_checkpoint
from megamoe.checkpoint.open import Checkpoint, open_checkpoint
from megamoe.core.config import ExpertStoreConfig
from megamoe.core.config_io import config_from_dict
from megamoe.core.errors import CheckpointError, ConfigError
from megamoe.model.build import build_model, stage_cut
from megamoe.parallel.groups import ParallelGroups


def load_model(path: str | Path, *, merge: bool = True, base: str | Path | None = None,
               expert_store: ExpertStoreConfig | None = None, keep_fp8: bool = False,
               groups: ParallelGroups | None = None):
    """The model in ``path`` in eval mode, with ``hf_origin`` set when known; on CPU in one
    process, or under ``groups`` this rank's pipeline stage (cut by ``Layout.stages(pp,
    balanced=True)``) with its own shards only. A LoRA checkpoint gives its base (``base``, else
    the one its meta.json records) with the adapters applied, merged into the weights unless
    ``merge=False`` (one process only). ``expert_store`` (an enabled ``ExpertStoreConfig``): the
    routed experts stay in the weights' converted checkpoint and come in when routed to
    (``megamoe.expert_store``; adapters then stay unmerged). ``keep_fp8``: an FP8 HF directory's
    weights stay e4m3 (``from_hf(keep_fp8=True)``; a converted checkpoint holds them as it was
    imported)."""
    tiered = expert_store is not None and expert_store.enabled
    stage = (0, 1) if groups is None else (groups.rank("pp"), groups.size("pp"))
    if (Path(path) / "config.json").is_file():
        from megamoe.convert import from_hf

        if tiered:
            raise CheckpointError(f"{path}: tiered experts read a converted checkpoint: megamoe-convert import-hf "
                                  f"{path} OUT first")
        return from_hf(path, groups, pipeline=stage, keep_fp8=keep_fp8)
    ck = open_checkpoint(path)
    if ck.is_lora and groups is not None:
        raise ConfigError(f"{ck.path}: a LoRA checkpoint decodes in one process; for a parallel layout merge it "
                          f"first (megamoe-convert export-hf --merge, then decode the HF folder)")
    config = ck.config
    if not tiered and (ck.meta.get("hf") or {}).get("experts_in_hf"):
        raise CheckpointError(f"{ck.path}: imported with --experts-in-hf, its routed experts are in "
                              f"{ck.meta['hf']['path']}: give --expert-budget (tiered experts read them from there)")
    if tiered and config.moe is not None:
        config.moe.expert_store = expert_store
        # redundant experts change no value and a store serves each expert once: decode without copies
        config.moe.redundant_experts, config.moe.replicas = 0, None
    model = build_model(config, groups, **stage_cut(config, stage))
    weights = ck if not ck.is_lora else load_lora(model, ck, base, merge and not tiered)
    if not ck.is_lora:
        load_checkpoint(ck.path, model.groups, [model], load_rng=False)
    if tiered:
        from megamoe.expert_store import open_expert_store

        model.expert_store = open_expert_store([model], model.groups, weights.path, config.moe.placement)
    hf = ck.meta.get("hf") or (weights.meta.get("hf") if ck.is_lora else None)
    if hf:
        model.hf_origin = hf
    return model.eval()


def load_lora(model, ck: Checkpoint, base: str | Path | None, merge: bool) -> Checkpoint:
    """The base weights into ``model``, then the adapters of ``ck`` on them (merged if ``merge``);
    returns the base checkpoint."""
    from megamoe.lora import LoRAConfig, apply_lora, is_adapter_name
    from megamoe.lora import merge as merge_lora

    weights = ck.base(base)
    load_checkpoint(weights.path, model.groups, [model], load_rng=False)
    apply_lora(model, config_from_dict(ck.meta["lora"], LoRAConfig))
    load_checkpoint(ck.path, model.groups, [model], load_rng=False, select=is_adapter_name)
    if merge:
        merge_lora(model)
    return weights
