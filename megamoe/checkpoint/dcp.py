"""Sharded, atomic, layout-independent checkpoints on ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own pieces. A tensor sharded over the grid is stored under
``<kind>/<name>#<piece>`` where the piece names this rank's position in the groups the
tensor is split over (``tp1of2.ep0of2``); replicated tensors are stored once under their
name. ``meta.json`` records the layout, so a checkpoint resumes on a different layout:
each rank loads the pieces it needs, reassembles full tensors with the tensors' own
``Shard`` rules and keeps its new piece.

Atomicity: everything is written under ``step_XXXXXXXX.tmp`` (marked as megamoe's partial
output) and renamed once every rank has finished; ``latest`` is replaced atomically after the
rename. A crash mid-save leaves the previous checkpoint untouched; an interruption (SIGTERM,
Ctrl-C) removes the partial folder on the way out. Loading goes through ``safe_dcp`` (an allow-list unpickler
for DCP's pickled ``.metadata``, tensors only), so loading a checkpoint never executes code.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megamoe.core.errors import CheckpointError
from megamoe.core.files import PARTIAL, mark_partial
from megamoe.core.interrupt import doing
from megamoe.core.untrusted import json_object, member
from megamoe.parallel.groups import ParallelGroups
from megamoe.checkpoint.pieces import (GROUPS, all_pieces, assemble, layout_sizes, my_ranks, piece_key,
                                       stored_rules, unchanged)
from megamoe.parallel.record import record
from megamoe.parallel.sharding import sharding, split_full
from megamoe.checkpoint.safe_dcp import SafeFileSystemReader, checkpoint_error, dcp_load, quiet  # noqa: F401

log = logging.getLogger(__name__)

META = "meta.json"
LATEST = "latest"
STAMP = "stamp/rank"  # + rank: [step, rank, world size], one per rank's file (check_stamps)


# ---- state collection --------------------------------------------------------------------

def model_tensors(parts) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of this rank's model chunks, by global name."""
    out: dict[str, torch.Tensor] = {}
    for chunk in parts:
        for name, t in chunk.state_dict(keep_vars=True).items():
            out.setdefault(name, t)
    return out


def _targets(model_parts, optimizer, create: bool = False, select=None) -> list[tuple]:
    """(tensor, kind, name, shard rules) for everything a checkpoint holds of this rank;
    ``select(name)`` limits the model tensors (adapter-only checkpoints of a LoRA fine-tune)."""
    # tiered experts' placeholders: the expert store holds their values (megamoe.expert_store)
    out = [(t.detach(), "model", name, sharding(t)) for name, t in model_tensors(model_parts).items()
           if (select is None or select(name)) and not record(t).stored]
    if optimizer is not None:
        for name, (param, state) in optimizer.owned_states(create=create).items():
            for field, value in state.items():
                # per-element states share the param's sharding; scalars (Adam's step) are replicated
                rules = sharding(param) if value.shape == param.shape else ()
                out.append((value, f"optim.{field}", name, rules))
    return out


# ---- save --------------------------------------------------------------------------------

def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _single_process() -> bool:
    """DCP without collectives: a world of one. Its gloo collectives would start gloo's run-loop
    threads, after which a CPU process's steps ran about twice as slowly (measured)."""
    return not dist.is_initialized() or dist.get_world_size() == 1


def _is_root() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _finalize(tmp: Path, final: Path, root: Path) -> None:
    """Make a fully written checkpoint visible: rename, then point ``latest`` at it. A folder of
    the same step already there (a run resumed from an earlier checkpoint, or re-run) is one
    megamoe wrote: it is moved aside first and removed once the new one is in place."""
    (tmp / PARTIAL).unlink(missing_ok=True)
    stale = None
    if final.exists():
        stale = final.with_name(f"{final.name}.replaced")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        mark_partial(stale)  # removed below; if interrupted first, by the next run
    os.replace(tmp, final)
    _write_json_atomic(root / LATEST, {"step_dir": final.name})
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def _agree(problem: str | None) -> str | None:
    """The first rank's problem, on every rank (a collective): all ranks stop or go on together."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, problem)
    return next((p for p in every if p), None)


def _space_problem(root: Path, items: dict[str, torch.Tensor], step: int) -> str | None:
    """Whether the disk under ``root`` lacks room for this rank's part of the checkpoint."""
    need = int(sum(t.numel() * t.element_size() for t in items.values()) * 1.05) + (1 << 20)
    where = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free >= need:
        return None
    return (f"{root}: not enough free disk for checkpoint step {step} ({need / 2**20:.1f} MiB needed on a rank, "
            f"{free / 2**20:.1f} MiB free); nothing written")


def _start(tmp: Path, items: dict, asynchronous: bool, group):
    """Begin the DCP write of ``items`` into ``tmp``: (future or None, failure as one line or None)."""
    try:
        with quiet():
            if asynchronous:
                return dcp.async_save(items, checkpoint_id=str(tmp), process_group=group, no_dist=_single_process()), None
            dcp.save(items, checkpoint_id=str(tmp), no_dist=_single_process())
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (CheckpointException is a BaseException)
        return None, str(checkpoint_error(tmp, "save", e))
    return None, None


class PendingSave:
    """A checkpoint being written. ``wait()`` (a collective) completes it: meta.json, then the
    rename and ``latest``, only once every rank's data is on disk; a failure on any rank removes
    the partial folder and leaves the previous checkpoint ``latest``."""

    def __init__(self, root: Path, step: int, meta: dict, keep_last: int, future=None, problem: str | None = None):
        self.root, self.step, self.meta, self.keep_last = root, step, meta, keep_last
        self.tmp, self.final = root / f"step_{step:08d}.tmp", root / f"step_{step:08d}"
        self.future, self.problem = future, problem

    def wait(self) -> Path:
        problem = self.problem
        if problem is None and self.future is not None:
            try:
                self.future.result()
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                problem = str(checkpoint_error(self.tmp, "save", e))
        if problem is None and _is_root():
            try:
                (self.tmp / META).write_text(json.dumps(self.meta, indent=2, sort_keys=True))
            except OSError as e:
                problem = str(checkpoint_error(self.tmp, "save", e))
        problem = _agree(problem)
        if problem:
            if _is_root():
                shutil.rmtree(self.tmp, ignore_errors=True)
            previous = latest_checkpoint(self.root)
            raise CheckpointError(f"{problem}; the partial save was removed, "
                                  f"{previous.name if previous else 'no checkpoint'} stays latest")
        if _is_root():
            _finalize(self.tmp, self.final, self.root)
            _prune(self.root, self.keep_last)
            log.info("saved checkpoint %s", self.final)
        _barrier()
        return self.final


def save_checkpoint(root: str | Path, step: int, groups: ParallelGroups, model_parts, optimizer=None,
                    trainer_state: dict | None = None, keep_last: int = 2, extra_meta: dict | None = None,
                    select=None, asynchronous: bool = False, async_group=None):
    """Write ``root/step_XXXXXXXX`` atomically (a collective: every rank calls it). ``select(name)``:
    which model tensors to write (default all). Too little free disk, or a failed write on any
    rank, is a ``CheckpointError`` on every rank; the partial folder is removed and the previous
    checkpoint stays ``latest``. ``asynchronous``: returns a ``PendingSave`` as soon as this rank's
    state is copied (DCP's async save writes it in a thread over ``async_group``); its ``wait()``
    completes the save. Otherwise returns the checkpoint's path."""
    root = Path(root)
    tmp = root / f"step_{step:08d}.tmp"
    ranks, sizes = my_ranks(groups), layout_sizes(groups)
    items = {piece_key(kind, name, rules, ranks, sizes): t for t, kind, name, rules in _targets(model_parts, optimizer, select=select)}
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    items[f"rng/rank{rank}"] = torch.get_rng_state().clone()
    items[f"{STAMP}{rank}"] = torch.tensor([step, rank, world])  # in this rank's file: check_stamps
    if asynchronous:  # training goes on and changes the live tensors: write a copy
        items = {k: t.detach().to("cpu", copy=True) for k, t in items.items()}
    problem = _agree(_space_problem(root, items, step))
    if problem:
        raise CheckpointError(problem)
    if _is_root():
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            if not (tmp / PARTIAL).is_file():
                raise CheckpointError(f"{tmp}: exists and is not a partial save of megamoe's; move it away")
            shutil.rmtree(tmp)
        tmp.mkdir()
        mark_partial(tmp)
    _barrier()
    meta = {**(extra_meta or {}), "step": step, "layout": layout_sizes(groups), "world_size": world,
            "stamped": True, "trainer_state": trainer_state or {}}
    with doing(f"saving checkpoint {tmp.name[:-4]} in {root}", lambda: _stays_latest(root)):
        try:
            future, problem = _start(tmp, items, asynchronous, async_group)
            pending = PendingSave(root, step, meta, keep_last, future, problem)
            return pending if asynchronous else pending.wait()
        except BaseException:  # an interruption (SIGTERM, Ctrl-C) mid-save: latest stays where it was
            if _is_root():
                shutil.rmtree(tmp, ignore_errors=True)
            raise


def _stays_latest(root: Path) -> str:
    latest = latest_checkpoint(root)
    return f"{latest.name} stays latest" if latest else "no checkpoint was written"


def _steps(root: Path) -> list[Path]:
    """Complete checkpoint folders (``step_XXXXXXXX`` with a meta.json), oldest first."""
    return sorted(p for p in root.glob("step_*") if re.fullmatch(r"step_\d{8}", p.name) and (p / META).is_file())


def _prune(root: Path, keep_last: int) -> None:
    for old in _steps(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    remove_partial_saves(root)


def remove_partial_saves(root: Path) -> None:
    """Remove ``step_X.tmp`` / ``step_X.replaced`` folders in ``root`` that carry megamoe's marker
    (its own partial saves; the run holds the folder's lock, so none is another run's)."""
    for stale in [*root.glob("step_*.tmp"), *root.glob("step_*.replaced")]:
        if (stale / PARTIAL).is_file():
            shutil.rmtree(stale, ignore_errors=True)


# ---- load --------------------------------------------------------------------------------

def checkpoints_newest_first(root: str | Path) -> list[Path]:
    """Complete checkpoints under root: the one ``latest`` names first, then the others by step,
    newest first (the candidates a resume tries in turn)."""
    root = Path(root)
    done = _steps(root)[::-1]
    pointer = root / LATEST
    if pointer.is_file():
        try:
            path = root / json_object(member(root, LATEST, str(root)))["step_dir"]
            if path in done:
                done.remove(path)
                done.insert(0, path)
        except (CheckpointError, KeyError, TypeError, OSError):
            log.warning("%s is unreadable; scanning for checkpoints", pointer)
    return done


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under root (``latest``, else the highest step_*)."""
    done = checkpoints_newest_first(root)
    return done[0] if done else None


MAX_GROUP = 1 << 16  # ranks in one parallel dimension: far beyond any machine, small enough to plan


def read_meta(path: str | Path) -> dict:
    """A checkpoint's ``meta.json`` (a regular file of the folder, bounded JSON), its parallel
    layout and model section checked for shape; the model's values are checked where it is built."""
    meta_file = Path(path) / META
    if not (meta_file.exists() or meta_file.is_symlink()):
        raise CheckpointError(f"{path}: not a megamoe checkpoint ({META} missing)")
    meta = json_object(member(path, META, str(path)))
    layout = meta.get("layout")
    if not (isinstance(layout, dict) and all(type(v) is int for v in layout.values())):
        raise CheckpointError(f"{meta_file}: not a megamoe checkpoint's meta.json (no parallel layout)")
    bad = next((k for k, v in layout.items() if k not in GROUPS or not 1 <= v <= MAX_GROUP), None)
    if bad is not None:
        raise CheckpointError(f"{meta_file}: layout.{bad[:40]}={layout[bad]} is not a parallel size "
                              f"(one of {', '.join(GROUPS)}, 1 to {MAX_GROUP})")
    for key, kind in (("model", dict), ("step", int), ("trainer_state", dict), ("hf", dict), ("lora", dict)):
        if meta.get(key) is not None and not isinstance(meta[key], kind):
            raise CheckpointError(f"{meta_file}: '{key}' is {str(meta[key])[:40]!r}, expected a JSON "
                                  f"{'object' if kind is dict else 'integer'}")
    return meta


def check_stamps(path: str | Path, meta: dict) -> None:
    """Every ``.distcp`` file of the checkpoint was written by a rank of this save: each holds its
    rank's stamp [step, rank, world size] and the stamps match ``meta.json``, so a file copied in
    from another step (mixed-step weights) is refused naming it. Checkpoints written before stamps
    (no ``stamped`` in meta.json) are not checked."""
    if not meta.get("stamped"):
        return
    path = Path(path)
    md = SafeFileSystemReader(str(path)).read_metadata()
    where = {getattr(i, "fqn", i): info.relative_path for i, info in (md.storage_data or {}).items()}
    stamps = {k: torch.zeros(3, dtype=torch.int64) for k in md.state_dict_metadata if k.startswith(STAMP)}
    unstamped = sorted(set(where.values()) - {where.get(k) for k in stamps})
    if unstamped or len(stamps) != meta.get("world_size"):
        what = f"{unstamped[0]} holds no rank's stamp" if unstamped else \
            f"{len(stamps)} rank stamps for world_size {meta.get('world_size')}"
        raise CheckpointError(f"{path}: {what}; the folder mixes files of different saves")
    _dcp_load(path, stamps)
    for key, stamp in sorted(stamps.items()):
        want = [meta.get("step"), int(key[len(STAMP):]), meta.get("world_size")]
        if stamp.tolist() != want:
            raise CheckpointError(f"{path / where.get(key, '?')}: written at step {stamp[0]} by rank {stamp[1]} of "
                                  f"{stamp[2]}, but meta.json is step {want[0]} (rank {want[1]} of {want[2]}): a file "
                                  f"from another checkpoint; refusing mixed-step weights")


def _load_into(path: Path, targets: list[tuple], groups: ParallelGroups, old_sizes: dict[str, int],
               batch_bytes: int = 256 << 20) -> None:
    """Load ``targets`` (tensor, kind, name, rules) in place. A tensor split as before is read
    as this rank's own piece; otherwise every old piece is read, the full tensor reassembled
    and the new piece kept. Reads go in batches of about ``batch_bytes`` to bound memory."""
    meta = SafeFileSystemReader(str(path)).read_metadata()  # read once: keys for stored_rules, shapes
    has_key = meta.state_dict_metadata.__contains__
    batch, size = [], 0
    for dest, kind, name, rules in targets:
        src = stored_rules(rules, kind, name, old_sizes, has_key)
        batch.append((dest, kind, name, rules, src))
        pieces = 1 if unchanged(rules, old_sizes, groups, src) else len(all_pieces(src, old_sizes))
        size += dest.numel() * dest.element_size() * pieces
        if size >= batch_bytes:
            _load_batch(path, batch, groups, old_sizes, meta)
            batch, size = [], 0
    if batch:
        _load_batch(path, batch, groups, old_sizes, meta)


def _load_batch(path: Path, batch: list[tuple], groups: ParallelGroups, old_sizes, meta) -> None:
    request: dict[str, torch.Tensor] = {}
    resharded = []
    for dest, kind, name, rules, src in batch:
        if unchanged(rules, old_sizes, groups, src):
            request[piece_key(kind, name, rules, my_ranks(groups), old_sizes)] = dest
            continue
        resharded.append((dest, kind, name, rules, src))
        for combo in all_pieces(src, old_sizes):
            request[piece_key(kind, name, src, combo, old_sizes)] = None
    if resharded:
        _fill_placeholders(path, request, meta)
    _dcp_load(path, request)
    for dest, kind, name, rules, src in resharded:
        piece = split_full(assemble(request.__getitem__, kind, name, src, old_sizes), rules, groups)
        if piece.shape != dest.shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(piece.shape)} after resharding, "
                                  f"the model holds {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(piece)


def _dcp_load(path: Path, request: dict[str, torch.Tensor]) -> None:
    dcp_load(path, request, no_dist=_single_process())


def _fill_placeholders(path: Path, request: dict, meta=None) -> None:
    """Allocate the request's ``None`` entries with the shapes/dtypes the checkpoint records
    (``meta``: its DCP metadata when the caller has read it already)."""
    meta = meta or SafeFileSystemReader(str(path)).read_metadata()
    for key in [k for k, v in request.items() if v is None]:
        entry = meta.state_dict_metadata.get(key)
        if entry is None:
            raise CheckpointError(f"{path}: checkpoint lacks tensor {key}")
        request[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)


def read_full_tensor(path: str | Path, meta: dict, name: str, rules) -> torch.Tensor:
    """One model tensor of a training checkpoint, reassembled from its pieces (for export)."""
    request = {piece_key("model", name, rules, combo, meta["layout"]): None
               for combo in all_pieces(rules, meta["layout"])}
    _fill_placeholders(Path(path), request)
    _dcp_load(Path(path), request)
    return assemble(request.__getitem__, "model", name, rules, meta["layout"])


def load_checkpoint(path: str | Path, groups: ParallelGroups, model_parts, optimizer=None,
                    load_rng: bool = True, select=None) -> dict:
    """Load model (and optimizer, RNG) state saved at any layout; returns the checkpoint's
    meta.json (its ``trainer_state`` holds step and data position). Converted checkpoints
    (``tools/convert.py import-hf``) hold weights only. ``select(name)``: which model tensors to
    load (an adapter-only checkpoint into a model whose base weights came from elsewhere)."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("format") == "megamoe-safetensors":
        from megamoe.checkpoint.converted import ConvertedCheckpoint

        targets = [(t, name, rules) for t, kind, name, rules in _targets(model_parts, None, select=select)]
        ConvertedCheckpoint(path, meta).load_into(targets, groups)
        log.info("loaded converted checkpoint %s (layout %s)", path, meta["layout"])
        return meta
    check_stamps(path, meta)
    if select is None and meta.get("lora") is not None:
        raise CheckpointError(f"{path}: an adapter-only LoRA checkpoint (its base weights: {meta.get('lora_base')}); "
                              "load the base and resume the adapters from checkpoint.dir, or export it merged")
    old = meta["layout"]
    _load_into(path, _targets(model_parts, optimizer, create=True, select=select), groups, old)
    if optimizer is not None:
        optimizer.follow_loaded_params()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if load_rng and meta.get("world_size") == world:
        state = {f"rng/rank{rank}": None}
        _fill_placeholders(path, state)
        _dcp_load(path, state)
        torch.set_rng_state(state[f"rng/rank{rank}"].clone())
    elif load_rng:
        log.warning("checkpoint was written by %s ranks, now %s: RNG states are reseeded", meta.get("world_size"), world)
    log.info("loaded checkpoint %s (step %s, layout %s)", path, meta.get("step"), old)
    return meta
