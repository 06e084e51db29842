"""A rank's expert store: the tiered layers of its model chunks, one cache, one source.

    store = open_expert_store(chunks, groups, path)   # after building, before the first forward
    ... forward/backward as usual; store.stats() ...
    store.close()

What the tiered experts layer (``megamoe.layers.mlp.stored_experts``) asks of it: ``calls_for``
(the routed local experts split into kernel calls) and ``run_call`` (one call: the weights
brought in, the kernel run on them, the next experts prefetched). Two ways to bring weights:

- mapped (the ``disk`` tier on a CPU, ``megamoe.expert_store.mapped``): the kernel runs on views of
  the store's memory-mapped files, its experts' pages mapped in first; autograd keeps the
  views, and a hook on the call's output maps them in again before the call's backward;
- copied (``megamoe.expert_store.slot_cache``; a GPU, the ``host`` tier, stores that cannot be viewed):
  ``stack`` copies the call's experts from the cache's slots into one buffer, w1 [n, 2f/etp, h]
  and w2 [n, h, f/etp], and ``saving`` is a context under which autograd saves, instead of any
  tensor that shares the stacks' memory, a note of where it came from, reading it back from
  the store when the backward needs it (``torch.autograd.graph.saved_tensors_hooks``). So the
  weights are held for one kernel call, not from forward to backward.

Prefetch (``prefetch_after``): the layer's next kernel call while this one computes, and the
next tiered layer's experts (those it was routed to last time: the routing is only known once
that layer's router has run). In the backward, each call brought back queues the one that the
backward meets next (the forward's order, reversed).

Budget: ``model.moe.expert_store.budget_mib``. Copied: the cache (three quarters) and the
stacks of one kernel call (a quarter: ``experts_per_call``). Mapped: the pages mapped in, a
call taking at most a quarter. A layer whose routed experts do not fit one call runs several
calls and sums their outputs (the kernel's output is a sum over experts, so this is exact up
to the order of float additions).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megamoe.core.config import ExpertStoreConfig
from megamoe.core.errors import CheckpointError, ConfigError
from megamoe.core.untrusted import json_object
from megamoe.parallel.groups import ParallelGroups
from megamoe.expert_store.slot_cache import ExpertCache
from megamoe.expert_store.hf import hf_expert_sources, is_hf_dir
from megamoe.expert_store import mapped
from megamoe.expert_store.source import DiskSource, ExpertTensors, HostSource

log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True)
class _SavedWeight:
    """What autograd keeps of a tensor sharing a stack's memory: which stack, and the view."""

    layer: str
    experts: tuple[int, ...]
    which: int  # 0: w1, 1: w2
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    step: int  # position in the forward's order of kernel calls (for the backward's prefetch)


class ExpertStore:
    def __init__(self, cfg: ExpertStoreConfig, layers: dict[str, nn.Module], sources: dict, device: torch.device,
                 dtype: torch.dtype, disk: DiskSource | None = None, views: dict | None = None):
        """``views``: {layer: (W1, W2)} over mapped files (the mapped way), else None (copied)."""
        self.cfg, self.layers, self.sources, self.disk = cfg, layers, sources, disk
        self.order = list(layers)  # forward order of the tiered layers
        budget = int(cfg.budget_mib * MIB)
        self.expert_bytes = max(m.expert_bytes() for m in layers.values())
        if budget < self.expert_bytes:  # a kernel call reads at least one expert: the budget would not hold
            raise ConfigError(f"model.moe.expert_store.budget_mib={cfg.budget_mib:g} (--expert-budget) is invalid: "
                              f"below one expert's weights ({self.expert_bytes / MIB:.4g} MiB), which a kernel "
                              "call holds at once")
        # a quarter of the budget for one call (at least one expert)
        self.per_call = max(1, budget // 4 // self.expert_bytes)
        shapes = {m.expert_shapes() for m in layers.values()}
        if len(shapes) != 1:
            raise ConfigError(f"model.moe.expert_store: the tiered layers' experts differ in shape ({sorted(shapes)})")
        self.shapes = shapes.pop()
        self.mapped = views is not None
        if self.mapped:  # the call's pages are among those mapped in: the whole budget
            self.cache = mapped.MappedExperts(views, budget, prefetch=cfg.prefetch)
        else:  # the call's stacks are a buffer of their own: the rest is the cache
            capacity = max(0, budget - self.per_call * self.expert_bytes)
            self.cache = ExpertCache(capacity, device, dtype, self.shapes, self._load, prefetch=cfg.prefetch)
        self.device, self.dtype = torch.device(device), dtype
        self.last_routed: dict[str, list[int]] = {}
        self.calls: list[tuple[str, tuple[int, ...]]] = []  # this step's kernel calls, in forward order
        self.in_backward = False
        self._buffer = None  # one kernel call's stacks (see stack)
        self._spare = None  # (layer, experts, which, stack): the other weight of the call read back last
        for name, m in layers.items():
            m.store, m.store_name = self, name

    # ---- the cache's callbacks ------------------------------------------------------------

    def _load(self, key, w1: torch.Tensor, w2: torch.Tensor) -> None:
        layer, expert = key
        self.sources[layer].read(self.layers[layer].local_start + expert, w1, w2)

    # ---- what the layer calls -------------------------------------------------------------

    def calls_for(self, experts: list[int]) -> list[list[int]]:
        """The routed (local) experts split into kernel calls of at most ``per_call``."""
        return [experts[i:i + self.per_call] for i in range(0, len(experts), self.per_call)]

    def run_call(self, layer: str, calls: list[list[int]], index: int, counts, kernel) -> torch.Tensor:
        """Call ``index`` of ``layer``: ``kernel(w1, w2, counts, experts)`` on its experts'
        weights (``counts``: every local expert's rows), prefetching what comes next."""
        experts = calls[index]
        if not self.mapped:
            w1, w2 = self.stack(layer, experts)
            self.prefetch_after(layer, calls, index)
            with self.saving(layer, experts, w1, w2):
                return kernel(w1, w2, [counts[e] for e in experts], experts)
        step = self._record_call(layer, experts)
        w1, w2 = self.cache.bring(layer, experts)  # all local experts' views; these mapped in
        self.prefetch_after(layer, calls, index)
        only = [0] * len(counts)  # the kernel walks only the experts with rows: this call's
        for e in experts:
            only[e] = counts[e]
        y = kernel(w1, w2, only, None)
        if y.requires_grad:  # fires before the call's backward, which reads the weights again
            y.register_hook(lambda grad: self._bring_back(layer, experts, step))
        return y

    def _record_call(self, layer: str, experts) -> int:
        """Note a kernel call in the step's forward order: its position (-1 without autograd:
        no backward will come to clear the record, e.g. every decode step of a generation)."""
        if not torch.is_grad_enabled():
            return -1
        self.calls.append((layer, tuple(experts)))
        return len(self.calls) - 1

    def _prefetch_before(self, step: int) -> None:
        """In the backward, before call ``step``: queue the call that the backward meets next."""
        self.in_backward = True
        if 0 < step <= len(self.calls):
            layer, experts = self.calls[step - 1]
            self.cache.prefetch([(layer, e) for e in experts])

    def _bring_back(self, layer: str, experts, step: int) -> None:
        self.cache.bring(layer, experts)  # first: marks them busy, so the prefetch cannot unmap them
        self._prefetch_before(step)

    def stack(self, layer: str, experts) -> tuple[torch.Tensor, torch.Tensor]:
        """w1 [n, 2f/etp, h], w2 [n, h, f/etp] of local ``experts`` (on the cache's device), in
        the store's one buffer: each kernel call of the forward, and each node of the backward
        that reads weights back, consumes its stacks before the next one fills the buffer
        (autograd keeps notes, not the stacks, and runs nodes one at a time; on a GPU the
        copies are ordered on the same stream as the kernels)."""
        if self._buffer is None:
            # per_call experts long (sliced): one call's stacks, a quarter of the budget
            self._buffer = tuple(torch.empty(self.per_call, *s, dtype=self.dtype, device=self.device)
                                 for s in self.shapes)
        self._spare = None  # the buffer is overwritten: the last read-back's other weight is gone
        w1, w2 = self._buffer
        for i, e in enumerate(experts):
            self.cache.copy((layer, e), w1[i], w2[i])
        return w1[:len(experts)], w2[:len(experts)]

    def routed(self, layer: str, experts: list[int]) -> None:
        """A forward of ``layer`` routes to ``experts``: starts a new step's record after a
        backward (a forward recomputed inside the backward, ``train.recompute``, continues it)."""
        if self.in_backward and torch._C._current_graph_task_id() < 0:  # not a recompute inside a backward
            self.calls.clear()
            self.in_backward = False
        self.last_routed[layer] = list(experts)

    def prefetch_after(self, layer: str, calls: list[list[int]], index: int) -> None:
        """While call ``index`` of ``layer`` computes: queue the layer's next call, else the
        next tiered layer's experts as last routed."""
        if index + 1 < len(calls):
            self.cache.prefetch([(layer, e) for e in calls[index + 1]])
            return
        at = self.order.index(layer)
        if at + 1 < len(self.order):
            nxt = self.order[at + 1]
            self.cache.prefetch([(nxt, e) for e in self.last_routed.get(nxt, [])])

    def saving(self, layer: str, experts, w1: torch.Tensor, w2: torch.Tensor):
        """Saved-tensor hooks for one kernel call (see the module docstring)."""
        step = self._record_call(layer, experts)
        # plain numbers only: autograd keeps the pack hook until the backward, and a reference
        # to the stacks here would keep every call's weights alive until then
        ptrs = {w.untyped_storage().data_ptr(): (which, w.storage_offset()) for which, w in enumerate((w1, w2))}
        device = w1.device

        def pack(t: torch.Tensor):
            hit = ptrs.get(t.untyped_storage().data_ptr()) if t.device == device else None
            if hit is None:
                return t
            which, offset = hit
            return _SavedWeight(layer, tuple(experts), which, t.storage_offset() - offset, tuple(t.shape),
                                tuple(t.stride()), step)

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedWeight):
            return saved
        self._prefetch_before(saved.step)
        spare, self._spare = self._spare, None
        if spare is not None and spare[:3] == (saved.layer, saved.experts, saved.which):
            stack = spare[3]  # read with the other weight of the same experts a moment ago
        else:
            stacks = self.stack(saved.layer, saved.experts)
            stack = stacks[saved.which]
            self._spare = (saved.layer, saved.experts, 1 - saved.which, stacks[1 - saved.which])
        return stack.as_strided(saved.size, saved.stride, stack.storage_offset() + saved.offset)

    # ---- inspection -----------------------------------------------------------------------

    def stats(self) -> dict:
        return {**self.cache.stats, "cached_bytes": self.cache.used, "capacity_bytes": self.cache.capacity,
                "experts_per_call": self.per_call, "mapped": self.mapped}

    def close(self) -> None:
        self.cache.close()
        if self.disk is not None:
            self.disk.close()


def stored_layers(parts) -> dict[str, nn.Module]:
    """The tiered experts modules of ``parts`` (model chunks) by full name, in model order."""
    from megamoe.layers.mlp.stored_experts import StoredExperts

    out = {}
    for part in parts:
        for name, m in part.named_modules():
            if isinstance(m, StoredExperts):
                out.setdefault(name, m)
    return out


def experts_home(root: str | Path) -> str | Path:
    """Where a checkpoint's routed experts are: itself, or the HF directory it was imported from
    when imported without them (``megamoe-convert import-hf --experts-in-hf``)."""
    meta = Path(root) / "meta.json"
    if meta.is_file():
        hf = json_object(meta).get("hf") or {}
        if hf.get("experts_in_hf"):
            return hf["path"]
    return root


def open_expert_store(parts, groups: ParallelGroups, path: str | Path | None = None,
                      placement: dict | None = None) -> ExpertStore | None:
    """Bind the tiered layers of ``parts`` to one store read from ``path`` (their config's
    ``path`` wins): a converted megamoe checkpoint, or the HF directory the model was imported
    from (``megamoe.expert_store.hf``; ``placement``: the model's ``moe.placement``, applied to its
    logical expert order). None when no layer is tiered. Checks every tensor the layers will
    read (one-line ``CheckpointError`` naming the file) before returning."""
    layers = stored_layers(parts if isinstance(parts, (list, tuple)) else [parts])
    if not layers:
        return None
    first = next(iter(layers.values()))
    cfg = first.store_cfg
    root = cfg.path or path
    if root is not None and not cfg.path:
        root = experts_home(root)
    if root is None:
        raise ConfigError("model.moe.expert_store.path is not set and there is no checkpoint to read the experts "
                          "from (set checkpoint.load or model.moe.expert_store.path)")
    device, dtype = first.anchor.device, first.anchor.dtype
    etp = (groups.rank("etp"), groups.size("etp"))
    if is_hf_dir(root):
        disk, readers = hf_expert_sources(root, layers, etp, placement)
    else:
        disk = DiskSource(root)
        readers = {name: ExpertTensors(disk, name, m.num_experts, m.ffn_hidden_size, m.hidden_size, etp,
                                       fp8_block=m.fp8_block) for name, m in layers.items()}
    sources = {}
    for name, m in layers.items():
        tensors = readers[name]
        if cfg.tier == "host":
            local = range(m.local_start, m.local_start + m.num_local)
            tensors = HostSource(tensors, local, m.expert_shapes(), dtype, pin=device.type == "cuda")
        sources[name] = tensors
    views = _mapped_views(cfg, layers, sources, device, dtype)
    store = ExpertStore(cfg, layers, sources, device, dtype, disk, views)
    log.info("expert store %s (%s tier, %s): %d layers, %.1f MiB budget, %d experts per call", root, cfg.tier,
             "mapped" if store.mapped else "copied", len(layers), cfg.budget_mib, store.per_call)
    return store


def _mapped_views(cfg: ExpertStoreConfig, layers: dict, sources: dict, device: torch.device,
                  dtype: torch.dtype) -> dict | None:
    """{layer: (W1, W2)} over the mapped store when every layer's experts can be viewed in
    place (``megamoe.expert_store.mapped``), else None (logged: why not)."""
    if not (cfg.map and cfg.tier == "disk" and device.type == "cpu" and mapped.AVAILABLE):
        return None
    views = {}
    for name, m in layers.items():
        source = sources[name]
        got = source.views(m.local_start, m.num_local, dtype) if hasattr(source, "views") else \
            "the experts are stored one tensor per weight"
        if isinstance(got, str):
            log.info("expert store: %s: copying experts into cache slots (%s)", name, got)
            return None
        views[name] = got
    return views
