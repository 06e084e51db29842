"""HF <-> megamoe conversion: in memory (``from_hf``, ``to_hf``) and between directories
(``import_hf``, ``export_hf``), streaming one tensor at a time."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from megamoe.core.config import ModelConfig, ParallelConfig, validate_model_parallel
from megamoe.convert.family import Family, get_family
from megamoe.checkpoint.hf_io import HFCheckpoint, write_hf_dir
from megamoe.checkpoint.converted import FORMAT, ConvertedCheckpoint, write_checkpoint
from megamoe.convert.keep_fp8 import fp8_producer, kept_to_hf, plan_fp8_base, split_fp8
from megamoe.convert.quant import (E4M3, FP8_DTYPES, DequantizedHF, QuantFormat, fp8_plan, fp8_record, fp8_stream,
                                   quant_format, set_quantization_config)
from megamoe.checkpoint.safetensors_io import DTYPE_OF_CODE
from megamoe.convert.table import Entry, check_plan, expand
from megamoe.core.errors import CheckpointError, ConfigError
from megamoe.core.files import AtomicDir, check_replaceable, is_checkpoint_dir
from megamoe.lora.adapters import adapter_of, has_lora
from megamoe.model.build import build_model, stage_cut
from megamoe.core.config_io import config_to_dict
from megamoe.parallel.groups import ParallelGroups
from megamoe.checkpoint.pieces import GROUPS
from megamoe.parallel.record import is_expert_param
from megamoe.parallel.sharding import full_shape, gather_full, shard_full, sharding
from megamoe.core.placement import to_logical, to_slots

log = logging.getLogger(__name__)


# ---- configs and models --------------------------------------------------------------------

def model_tensors(model) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (what a checkpoint holds)."""
    return dict(model.state_dict(keep_vars=True))


def plan_entries(family: Family, cfg: ModelConfig, hf_config: dict, available: set[str] | None) -> list[Entry]:
    """The family's mapping table expanded for ``cfg``: one entry per megamoe tensor (its HF
    tensors and rule); ``available``: the HF tensor names a checkpoint holds (None: any)."""
    return expand(family.rules(cfg, hf_config), cfg, hf_config, available)


# ---- HF -> megamoe -------------------------------------------------------------------------

def open_hf(hf_dir) -> tuple[HFCheckpoint | DequantizedHF, Family, ModelConfig]:
    """(the checkpoint's headers, its family, the megamoe config) of an HF directory. An FP8
    checkpoint (``quantization_config``, ``megamoe.convert.quant``) is seen dequantised to the
    model's ``params_dtype``: its tensors read as they would from a dequantised copy."""
    ck = HFCheckpoint(hf_dir)
    source = str(Path(hf_dir) / "config.json")
    family = get_family(ck.config.get("model_type"), source)
    cfg = family.config_from_hf(ck.config)
    _drop_absent_mtp(ck, family, cfg)
    cfg.validate()
    fmt = quant_format(ck.config, source)
    if fmt is not None:
        return DequantizedHF(ck, fmt, getattr(torch, cfg.params_dtype), family), family, cfg
    fp8 = sorted(n for n, d in ck.dtypes.items() if d in FP8_DTYPES)
    if fp8:  # values without a declared format: their scales cannot be applied
        raise CheckpointError(f"{ck.path}: tensor {fp8[0]} is {ck.dtypes[fp8[0]]} but {source} has no "
                              f"quantization_config naming its format; dequantise the checkpoint first")
    return ck, family, cfg


def _drop_absent_mtp(ck: HFCheckpoint, family: Family, cfg: ModelConfig) -> None:
    """Configs count multi-token-prediction layers that a checkpoint may not hold (transformers'
    deepseek_v3 defaults to one and never saves it): with none of their tensors there, the model
    is built without them; with some, the plan names the first one missing."""
    if cfg.mtp is None:
        return
    needed = {n for e in plan_entries(family, cfg, ck.config, ck.names) if e.mm.startswith("mtp.") for n in e.hf}
    if not needed & ck.names:
        log.info("%s: the config counts %d multi-token-prediction layer(s) but the checkpoint holds none; "
                 "converting the model without them", ck.path, cfg.mtp.num_layers)
        cfg.mtp = None


def _checked_plan(ck: HFCheckpoint, family: Family, cfg: ModelConfig, meta_tensors: dict) -> list[Entry]:
    """The mapping table expanded for this checkpoint, its coverage and shapes checked, and every
    source of a floating-point megamoe tensor in a format the family converts (no silent casts
    of integer or quantised weights)."""
    entries = plan_entries(family, cfg, ck.config, ck.names)
    skipped, why = family.skipped(ck.config, ck.names) if family.skipped else (set(), "")
    if skipped:
        log.warning("%s: %d tensors not converted: %s", ck.path, len(skipped), why)
    shapes = {n: tuple(t.shape) for n, t in meta_tensors.items()}
    check_plan(entries, shapes, {n: s for n, s in ck.shapes.items() if n not in skipped}, str(ck.path))
    allowed = family.weight_dtypes - FP8_DTYPES  # FP8 only through its format (dequantised: never seen here)
    for e in entries:
        if not meta_tensors[e.mm].dtype.is_floating_point:
            continue
        for name in e.hf:
            if ck.dtypes[name] not in allowed:
                raise CheckpointError(f"{ck.path}: tensor {name} is {ck.dtypes[name]}, which {family.model_type} "
                                      f"does not convert without a quantization_config naming its format (integer "
                                      f"or quantised weights; expected one of {', '.join(sorted(allowed))}); "
                                      f"dequantise the checkpoint first")
    return entries


class HFWeights:
    """An HF directory opened for megamoe: its headers (``ck``), family, megamoe config (``cfg``)
    and mapping entries, checked on the headers before a byte is read. ``fill(tensors, groups)``
    reads the HF tensors behind the given megamoe tensors one at a time, each sliced to this
    rank's shard and dropped before the next: ``from_hf`` fills a whole model (or stage) with it,
    the streamed comparison (``megamoe.diagnostics.streamed``) one layer at a time.
    ``keep_fp8``: an FP8 checkpoint's weights stay e4m3 (``cfg.fp8_base`` set)."""

    def __init__(self, hf_dir: str | Path, *, placement: dict | None = None, keep_fp8: bool = False,
                 replicas: dict | None = None):
        self.path = Path(hf_dir)
        self.ck, self.family, self.cfg = open_hf(hf_dir)
        _set_placement(self.cfg, placement, replicas)
        self.entries, self.produce_fp8 = _plan(self.ck, self.family, self.cfg, keep_fp8)

    def fill(self, tensors: dict[str, torch.Tensor], groups: ParallelGroups, progress: bool = False) -> None:
        """Copy into each of ``tensors`` (megamoe name -> this rank's tensor) its HF values."""
        entries = [e for e in self.entries if e.mm in tensors]
        for e in tqdm(entries, desc="load HF", disable=not progress, unit="tensor"):
            for name in (e.mm, f"{e.mm}_scale") if f"{e.mm}_scale" in tensors else (e.mm,):
                full = self.produce_fp8(name)
                full = e.to_mm([self.ck.tensor(n) for n in e.hf]) if full is None else full
                full = to_slots(name, full, _placement(self.cfg))
                dest = tensors[name]
                with torch.no_grad():
                    dest.copy_(shard_full(full.to(dest.dtype), dest, groups))

    def origin(self) -> dict:
        """What ``model.hf_origin`` records: the family, its config and where the weights are."""
        origin = {"model_type": self.family.model_type, "config": self.ck.config, "path": str(self.path.resolve())}
        if self.ck.scales:
            origin["fp8"] = fp8_record(self.ck)
        return origin


def from_hf(hf_dir: str | Path, groups: ParallelGroups | None = None, *, sequence_parallel: bool = False,
            device=None, progress: bool = False, fp8: str | None = None, placement: dict | None = None,
            pipeline: tuple[int, int] = (0, 1), keep_fp8: bool = False, replicas: dict | None = None):
    """A megamoe model holding an HF checkpoint's weights (this rank's shards under ``groups``);
    ``fp8``: the backend's FP8 recipe (as ``train.fp8``); ``placement``: {layer: expert order}
    laid out over the EP slots (``megamoe.core.placement``; recorded in ``model.moe.placement``);
    ``replicas``: {layer: [HF expert ids]} copied into redundant slots (``model.moe.redundant_experts``).
    ``pipeline`` (stage, stages): build and load only that pipeline stage's layers (``stage_cut``);
    tensors of other stages are never read. Each tensor is read, sliced to this rank's shard and
    dropped before the next, so the whole model is never in one process.

    ``model(input_ids)`` returns logits [b, t, V]. The HF origin is kept on ``model.hf_origin``
    so ``to_hf`` can write the same family back. ``keep_fp8``: an FP8 checkpoint's weights stay
    e4m3 with their block scales (``model.fp8_base``, ``megamoe.model.fp8_base``).
    """
    weights = HFWeights(hf_dir, placement=placement, keep_fp8=keep_fp8, replicas=replicas)
    groups = groups or ParallelGroups()
    model = build_model(weights.cfg, groups, sequence_parallel=sequence_parallel, device=device, fp8=fp8,
                        **stage_cut(weights.cfg, pipeline))
    weights.fill(model_tensors(model), groups, progress)  # this pipeline stage's tensors only
    model.hf_origin = weights.origin()
    return model.eval()


def _plan(ck, family: Family, cfg: ModelConfig, keep_fp8: bool):
    """(the checked entries, ``produce(name)`` of the FP8 weights kept and their scales, None for
    any other name); with ``keep_fp8`` ``cfg.fp8_base`` is set to the weights kept."""
    with torch.device("meta"):
        plain = build_model(cfg, device="meta")
    entries = _checked_plan(ck, family, cfg, model_tensors(plain))
    if not keep_fp8:
        return entries, lambda name: None
    cfg.fp8_base = plan_fp8_base(ck, entries, plain)
    return entries, fp8_producer(ck, {e.mm: e for e in entries}, cfg.fp8_base)


def import_hf(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1,
              shard_bytes: int = 2 << 30, overwrite: bool = False, progress: bool = True,
              placement: dict | None = None, experts: bool = True, keep_fp8: bool = False,
              replicas: dict | None = None) -> Path:
    """Convert an HF directory into a megamoe checkpoint (optionally split for a TP/PP/EP layout;
    ``placement``: {layer: expert order} over the EP slots, ``replicas``: {layer: [HF expert ids]}
    in redundant slots, see ``megamoe.core.placement``; both recorded in the checkpoint's config).
    Replicas are no tensors of their own: the checkpoint holds each expert once.
    ``experts=False``: the routed experts stay in ``hf_dir`` only (never read here); runs with
    tiered experts (``model.moe.expert_store``) read them from there (``megamoe.expert_store.hf``).
    ``keep_fp8``: an FP8 checkpoint's weights are written as e4m3 + block scales
    (``megamoe.convert.keep_fp8``), the others dequantised."""
    start = time.time()
    inputs = [("HF_DIR", hf_dir)]
    check_replaceable(Path(out_dir), overwrite, is_checkpoint_dir, "checkpoint", inputs=inputs)  # before any reading
    ck, family, cfg = open_hf(hf_dir)
    _set_placement(cfg, placement, replicas)
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp)
    layout = validate_model_parallel(cfg, parallel)
    entries, produce_fp8 = _plan(ck, family, cfg, keep_fp8)
    with torch.device("meta"):
        meta_tensors = model_tensors(build_model(cfg, device="meta"))
    by_name = {e.mm: e for e in entries}
    planned = []
    for name, t in meta_tensors.items():
        if not experts and is_expert_param(t):  # the routed experts' stacks (their record: sharded over ep/etp)
            continue
        dtype = t.dtype  # kept FP8 weights (e4m3) and their scales (float32) as the model holds them
        if name in by_name and dtype != E4M3:
            src_dtype = DTYPE_OF_CODE[ck.dtypes[by_name[name].hf[0]]]
            dtype = src_dtype if src_dtype.is_floating_point and t.dtype.is_floating_point else t.dtype
        planned.append((name, dtype, tuple(t.shape), sharding(t)))
    sizes = {g: 1 for g in GROUPS} | {"tp": tp, "pp": pp, "ep": ep, "etp": etp}
    # hf.path: where the weights came from (a PEFT adapter of a fine-tune names it as its base)
    hf = {"model_type": family.model_type, "config": ck.config, "path": str(Path(hf_dir).resolve())}
    if not experts:
        hf["experts_in_hf"] = True  # megamoe.expert_store reads the routed experts from hf["path"]
    if ck.scales:
        hf["fp8"] = fp8_record(ck)  # an export with --fp8-blocks writes these tensors in FP8 again
    meta = {"step": 0, "model": config_to_dict(cfg), "hf": hf,
            "trainer_state": {}}
    bar = tqdm(total=len(planned), desc=f"import {family.model_type}", unit="tensor", disable=not progress)

    def produce(name: str) -> torch.Tensor:
        full = produce_fp8(name)
        if full is None:
            e = by_name[name]
            full = e.to_mm([ck.tensor(n) for n in e.hf])
        return to_slots(name, full, _placement(cfg))

    with AtomicDir(out_dir, overwrite, inputs=inputs) as tmp:
        write_checkpoint(tmp, meta, planned, produce, sizes, layout.stages(pp), shard_bytes, bar)
    bar.close()
    log.info("imported %s (%s) into %s in %.1fs", hf_dir, family.model_type, out_dir, time.time() - start)
    return Path(out_dir)


def _placement(cfg: ModelConfig) -> dict:
    return (cfg.moe.placement or {}) if cfg.moe is not None else {}


def _set_placement(cfg: ModelConfig, placement: dict | None, replicas: dict | None = None) -> None:
    """Record an expert placement (and the replicas of redundant slots) in the config the weights
    will be laid out by."""
    if not placement and not replicas:
        return
    if cfg.moe is None:
        raise ConfigError("placement: the model has no routed experts")
    if placement:
        cfg.moe.placement = {str(k): [int(e) for e in v] for k, v in placement.items()}
    if replicas:
        cfg.moe.replicas = {str(k): [int(e) for e in v] for k, v in replicas.items()}
        cfg.moe.redundant_experts = len(next(iter(cfg.moe.replicas.values())))
    cfg.validate()


# ---- megamoe -> HF -------------------------------------------------------------------------

def _hf_plan(entries: list[Entry], dtype_of) -> list[tuple[str, torch.dtype, tuple]]:
    planned = []
    for e in entries:
        shape, dtype = dtype_of(e.mm)
        outs = e.to_hf(torch.empty(shape, dtype=dtype, device="meta"))
        if len(outs) != len(e.hf):
            raise CheckpointError(f"mapping table: {e.mm} gives {len(outs)} HF tensors for {len(e.hf)} names")
        planned += [(n, t.dtype, tuple(t.shape)) for n, t in zip(e.hf, outs)]
    return planned


def _write_hf(out_dir, family: Family, cfg: ModelConfig, hf_config: dict | None, shapes_dtypes,
              read_full, overwrite: bool, progress: bool, shard_bytes: int = 5 << 30,
              fp8_blocks: int | None = None, fp8_origin: dict | None = None, inputs=()) -> Path:
    """``fp8_blocks``: write the tensors an FP8 release quantises (those ``fp8_origin`` recorded
    at import, else every linear weight of the layers) as e4m3 + ``weight_scale_inv`` per
    ``fp8_blocks`` square block, with config.json's ``quantization_config``."""
    if fp8_blocks is not None and not family.maps_fp8:
        raise CheckpointError(f"--fp8-blocks: {family.model_type} has no FP8 format (megamoe-convert families)")
    config = family.config_to_hf(cfg, hf_config)
    fmt = QuantFormat((fp8_blocks, fp8_blocks)) if fp8_blocks else None
    set_quantization_config(config, fmt)
    entries = plan_entries(family, cfg, config, None)
    shapes_dtypes, kept = split_fp8(shapes_dtypes)  # weights kept in FP8 (model.fp8_base) are planned as float
    check_plan(entries, {n: s for n, (s, _) in shapes_dtypes.items()}, None, "export")
    planned, quantised = _hf_plan(entries, shapes_dtypes.__getitem__), set()
    if fmt is not None:
        planned, quantised = fp8_plan(planned, fmt, fp8_origin)
    bar = tqdm(total=len(entries), desc=f"export {family.model_type}", unit="tensor", disable=not progress)
    logical = lambda name: to_logical(name, read_full(name), _placement(cfg))  # noqa: E731  (HF: logical order)

    def stream():
        for e in entries:
            if e.mm in kept:
                outs = kept_to_hf(e, logical(e.mm), logical(f"{e.mm}_scale"), tuple(cfg.fp8_base.block),
                                  getattr(torch, cfg.params_dtype), fmt, quantised)
            else:
                outs = e.to_hf(logical(e.mm))
            yield from zip(e.hf, (o if isinstance(o, tuple) else o.contiguous() for o in outs))
            bar.update(1)

    tensors = fp8_stream(stream(), quantised, fmt) if fmt is not None else stream()
    path = write_hf_dir(out_dir, config, planned, tensors, shard_bytes=shard_bytes, overwrite=overwrite, inputs=inputs)
    bar.close()
    return path


def _base_tensors(model) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint holds: LoRA adapters must be merged first (their factors are
    then left out) or written separately (``megamoe.convert.export_peft``), never dropped silently."""
    if any(not adapter_of(m).merged for m in model.modules() if has_lora(m)):
        raise CheckpointError("to_hf: the model carries unmerged LoRA adapters; fold them in with "
                              "megamoe.lora.merge(model) or write them with megamoe.convert.export_peft")
    return {n: t for n, t in model_tensors(model).items() if "lora_" not in n.rsplit(".", 1)[-1]}


def to_hf(model, out_dir: str | Path, *, family: str | None = None, hf_config: dict | None = None,
          groups: ParallelGroups | None = None, overwrite: bool = False, progress: bool = False,
          shard_bytes: int = 5 << 30, fp8_blocks: int | None = None, inputs=()) -> Path:
    """Write ``model`` as an HF checkpoint that ``transformers`` loads with its Auto classes.

    The family comes from ``family``, else from the model's HF origin (``from_hf``). Under a
    parallel layout every rank must call it (tensors are gathered); rank 0 writes.
    ``fp8_blocks``: the family's FP8 format with that block size (``megamoe.convert.quant``).
    ``inputs``: (name, path) of what the model was read from, which ``out_dir`` must stay apart from.
    """
    origin = getattr(model, "hf_origin", None) or {}
    fam = get_family(family or origin.get("model_type"), "to_hf")
    hf_config = hf_config if hf_config is not None else origin.get("config")
    groups = groups or ParallelGroups()
    tensors = _base_tensors(model)
    shapes = {n: (tuple(full_shape(t, groups)), t.dtype) for n, t in tensors.items()}
    return _write_hf(out_dir, fam, model.config, hf_config, shapes,
                     lambda n: gather_full(tensors[n], groups), overwrite, progress, shard_bytes,
                     fp8_blocks, origin.get("fp8"), inputs)


def open_megamoe_checkpoint(path: str | Path):
    """(meta, config, meta-device tensors, full-tensor reader) for a converted checkpoint, a
    training checkpoint (step_XXXXXXXX) or a training run's directory (its latest checkpoint)."""
    from megamoe.checkpoint.dcp import read_full_tensor
    from megamoe.checkpoint.open import open_checkpoint

    ck = open_checkpoint(path)
    cfg = ck.config
    with torch.device("meta"):
        tensors = model_tensors(build_model(cfg, device="meta"))
    if ck.meta.get("format") == FORMAT:
        converted = ConvertedCheckpoint(ck.path, ck.meta)
        return ck.meta, cfg, tensors, lambda n: converted.full(n, sharding(tensors[n]))
    return ck.meta, cfg, tensors, lambda n: read_full_tensor(ck.path, ck.meta, n, sharding(tensors[n]))


def export_hf(ckpt_dir: str | Path, out_dir: str | Path, *, family: str | None = None,
              overwrite: bool = False, progress: bool = True, shard_bytes: int = 5 << 30,
              fp8_blocks: int | None = None) -> Path:
    """A megamoe checkpoint (converted or from training) -> an HF directory (``fp8_blocks``: in
    the family's FP8 format with that block size)."""
    inputs = [("checkpoint", ckpt_dir)]
    check_replaceable(Path(out_dir), overwrite, is_checkpoint_dir, "checkpoint", inputs=inputs)  # before any reading
    meta, cfg, tensors, read_full = open_megamoe_checkpoint(ckpt_dir)
    origin = meta.get("hf") or {}
    if not (family or origin.get("model_type")):
        raise CheckpointError(f"{ckpt_dir}: the weights did not come from an HF checkpoint; name the HF family "
                              f"to export to (--family / family=), e.g. qwen3_5_moe")
    fam = get_family(family or origin.get("model_type"), f"{ckpt_dir}/meta.json")
    # tensors are exported in the model's parameter dtype (model.params_dtype)
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    return _write_hf(out_dir, fam, cfg, origin.get("config"), shapes,
                     lambda n: read_full(n).to(shapes[n][1]), overwrite, progress, shard_bytes,
                     fp8_blocks, origin.get("fp8"), inputs)
