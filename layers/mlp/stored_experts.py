"""Routed experts whose FROZEN weights live in an expert store (``model.moe.expert_store``).

The same maths as ``GroupedExperts`` (``compute`` is inherited, adapters included): only
where the weights come from differs. The module holds no expert weights: its
``gate_up_weight`` [E/ep, 2f/etp, h] and ``down_weight`` [E/ep, h, f/etp] are meta-device
placeholders (shapes, sharding and parameter counts stay those of the resident layer; the
record's ``stored`` flag keeps initialisation, checkpoints and ``.to()`` away from them).

Per forward, with the routed local experts known from ``counts``::

    active = experts with rows                    (only these are brought in)
    calls  = active split into store.calls_for()  (each call's experts fit a quarter of the budget)
    out    = sum over calls of compute(rows of the call, the call's experts' weights)

The rows of consecutive experts are consecutive in the grouped order, so a call takes a
slice of ``idx``/``probs``. How the weights come in (views of the mapped store, or stacks
copied from a cache) and back for the backward is the store's business
(``store.run_call``, ``megamoe.expert_store.store``). The store is bound after building
(``megamoe.expert_store.open_expert_store``). FP8 experts (``model.fp8_base``) come in
dequantised to the model's dtype: the layer computes as it would on float weights.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megamoe.core.config import ExpertStoreConfig
from megamoe.core.errors import ConfigError
from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.layers.mlp.experts import GroupedExperts, reference_kernel
from megamoe.layers.mlp.dense import SWIGLU, GLU
from megamoe.parallel.record import update_record
from megamoe.layers.spec import BuildContext

STORED = ("gate_up_weight", "down_weight")


class StoredExperts(GroupedExperts):
    def __init__(self, ctx: BuildContext, num_experts: int, ffn_hidden_size: int, *, store: ExpertStoreConfig,
                 kernel: str = "auto", active_fraction: float = 1.0, glu: GLU = SWIGLU,
                 fusion: Fusion = EAGER, auto_kernel=reference_kernel):
        super().__init__(dataclasses.replace(ctx, device="meta"), num_experts, ffn_hidden_size, kernel=kernel,
                         active_fraction=active_fraction, glu=glu, fusion=fusion, auto_kernel=auto_kernel)
        for name in STORED:
            update_record(getattr(self, name).requires_grad_(False), stored=True)
        # the device and dtype the weights are brought to (follows .to() like any buffer)
        self.register_buffer("anchor", torch.empty(0, dtype=ctx.dtype, device=ctx.device), persistent=False)
        self.store_cfg = store
        self.store = None  # bound by megamoe.expert_store.open_expert_store
        # the stored experts are e4m3 with scales per fp8_block columns (model.fp8_base lists them;
        # set by megamoe.model.fp8_base.keep_fp8): the store dequantises them when it brings them in
        self.fp8_block = None
        self.store_name = None

    def _apply(self, fn, recurse=True):
        """``.to()``/``.float()`` move the module but not the placeholders (meta stays meta)."""
        held = {n: self._parameters.pop(n) for n in STORED}
        try:
            return super()._apply(fn, recurse)
        finally:
            rest = dict(self._parameters)
            self._parameters.clear()
            self._parameters.update({**held, **rest})

    def weight_like(self) -> torch.Tensor:
        return self.anchor

    def expert_bytes(self) -> int:
        s1, s2 = self.expert_shapes()
        return (s1[0] * s1[1] + s2[0] * s2[1]) * self.anchor.element_size()

    def resolved_kernel(self) -> str:
        return self.kernel_for(self.anchor)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, counts: Sequence[int], probs: torch.Tensor | None,
                out_rows: int) -> torch.Tensor:
        store = self.store
        if store is None:
            raise ConfigError(f"{self.store_name or 'experts'}: model.moe.expert_store is set but no store is open "
                              "(megamoe.expert_store.open_expert_store)")
        active = [e for e, n in enumerate(counts) if n]
        store.routed(self.store_name, active)
        out = None
        start = 0
        calls = store.calls_for(active)
        for i, experts in enumerate(calls):
            rows = slice(start, start + sum(counts[e] for e in experts))
            start = rows.stop
            p = None if probs is None else probs[rows]
            y = store.run_call(self.store_name, calls, i, counts,
                               lambda w1, w2, n, which: self.compute(x, idx[rows], n, p, w1, w2, out_rows, which))
            out = y if out is None else out + y
        return x.new_zeros(out_rows, x.size(-1)) if out is None else out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tiered (budget {self.store_cfg.budget_mib} MiB, {self.store_cfg.tier})"
