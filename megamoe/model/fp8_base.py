"""A frozen FP8 base: the released e4m3 weights and their block scales kept as they are.

``model.fp8_base`` (``Fp8BaseConfig``, written by ``import-hf --keep-fp8``) names the linear and
routed-expert weights held in FP8. After a model is built, ``keep_fp8`` turns each named weight
``X`` of its role into

    X            e4m3, the weight's own shape and shard rules, frozen (requires_grad False)
    X_scale      float32 [..., N, C]: the block scales repeated over their rows (shard rules
                 of X's row dims; replicated over a group that splits X's columns)
    X_col_block  int64 [K_local], not saved: each local column's block of the full K

(``megamoe.layers.ops.fp8.frozen`` has the maths), so checkpoints hold e4m3 + scales and any layout
reads its own pieces. The role's entry points then go through the backend's frozen-FP8 roles,
on this instance, as LoRA's adapters do (``megamoe.lora.adapters``): a linear role's
``local_linear`` / ``effective_weight``, a routed-experts role's ``forward`` (the routed
experts dequantised per call, recomputed in the backward instead of kept). LoRA adapters and
every other parameter stay in ``params_dtype``; ``thaw`` turns a role back into plain float
weights (what merging an adapter into it does). Routed experts in an expert store
(``model.moe.expert_store``) stay there: the store reads their e4m3 values and scales and brings
them in dequantised (``role.fp8_block`` tells it the scales' column block).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megamoe.core.config import Fp8BaseConfig
from megamoe.core.errors import ConfigError
from megamoe.layers.ops.fp8.frozen import dequantize_rows
from megamoe.parallel.record import record
from megamoe.parallel.sharding import const_init, full_shape, mark_init, set_sharding, sharding, split_full

E4M3 = torch.float8_e4m3fn
EXPERT_WEIGHTS = ("gate_up_weight", "down_weight")


def role_weights(module: nn.Module) -> tuple[str, ...]:
    """The weights of a linear role (``weight`` + ``local_linear``) or a routed-experts role, by
    interface (as ``megamoe.lora.adapters.role_kind``); () for any other module."""
    if isinstance(getattr(module, "weight", None), torch.Tensor) and callable(getattr(module, "local_linear", None)):
        return ("weight",)
    if all(isinstance(getattr(module, w, None), torch.Tensor) for w in EXPERT_WEIGHTS):
        return EXPERT_WEIGHTS
    return ()


def fp8_candidates(model: nn.Module) -> set[str]:
    """Parameter names ``model.fp8_base.tensors`` may list (the roles' weights, vision tower aside)."""
    return {f"{name}.{w}" for name, m in model.named_modules() for w in role_weights(m)
            if not (name == "vision" or name.startswith("vision."))}


def scale_names(model: nn.Module) -> set[str]:
    """Names of the FP8 weights' scale parameters: bytes, not parameters of the model (counts skip them)."""
    return {f"{n}_scale" for n, p in model.named_parameters() if p.dtype == E4M3}


def is_fp8(module: nn.Module) -> bool:
    return bool(module.__dict__.get("fp8_weights"))


def _freeze(role: nn.Module, attr: str, block_cols: int, groups) -> None:
    """Swap float ``role.<attr>`` for e4m3 values + scales (zero / one until loaded)."""
    old = getattr(role, attr)
    last = old.dim() - 1
    rules = sharding(old)
    k_full = full_shape(old, groups)[-1]
    q = nn.Parameter(torch.zeros(old.shape, dtype=E4M3, device=old.device), requires_grad=False)
    q._megamoe = dataclasses.replace(record(old))
    mark_init(q, const_init(0.0))
    scale = nn.Parameter(torch.ones(*old.shape[:-1], math.ceil(k_full / block_cols), device=old.device),
                         requires_grad=False)
    scale._megamoe = dataclasses.replace(record(old))
    set_sharding(scale, *(r for r in rules if r.dim != last))
    mark_init(scale, const_init(1.0))
    columns = split_full(torch.arange(k_full), [dataclasses.replace(r, dim=0) for r in rules if r.dim == last], groups)
    delattr(role, attr)
    role.register_parameter(attr, q)
    role.register_parameter(f"{attr}_scale", scale)
    role.register_buffer(f"{attr}_col_block", (columns // block_cols).to(old.device), persistent=False)


def _weight(role: nn.Module, attr: str, dtype: torch.dtype, deq) -> torch.Tensor:
    return deq(getattr(role, attr), getattr(role, f"{attr}_scale"), getattr(role, f"{attr}_col_block"), dtype)


def _install_linear(role: nn.Module, backend, ctx, dtype: torch.dtype) -> None:
    gemm, deq = backend.frozen_fp8_linear(ctx), backend.frozen_fp8_weight(ctx)

    def local_linear(x: torch.Tensor) -> torch.Tensor:
        bias = role.bias if role.local_bias else None
        return gemm(x, role.weight, role.weight_scale, role.weight_col_block, bias)

    _set_entries(role, local_linear=local_linear, effective_weight=lambda: _weight(role, "weight", dtype, deq),
                 weight_like=lambda: role.weight_scale.new_empty(0, dtype=dtype))


def _install_experts(role: nn.Module, backend, ctx, dtype: torch.dtype) -> None:
    deq = backend.frozen_fp8_weight(ctx)

    def forward(x, idx, counts, probs, out_rows):
        """Only the routed local experts are dequantised (experts without rows add nothing)."""
        active = [e for e, n in enumerate(counts) if n]
        if not active:
            return x.new_zeros(out_rows, x.size(-1))
        sel = torch.tensor(active, device=x.device)
        n = [counts[e] for e in active]

        def run(x, probs):
            w1, w2 = (deq(getattr(role, a).index_select(0, sel), getattr(role, f"{a}_scale").index_select(0, sel),
                          getattr(role, f"{a}_col_block"), x.dtype) for a in EXPERT_WEIGHTS)
            return role.compute(x, idx, n, probs, w1, w2, out_rows, active)

        if torch.is_grad_enabled():  # the backward dequantises again: no copy kept in between
            return checkpoint(run, x, probs, use_reentrant=False)
        return run(x, probs)

    _set_entries(role, forward=forward, weight_like=lambda: role.gate_up_weight_scale.new_empty(0, dtype=dtype))


def _set_entries(role: nn.Module, **entries) -> None:
    """Replace the role's entry points on this instance (``thaw`` takes back these, not others')."""
    role.__dict__["fp8_entries"] = entries
    for name, fn in entries.items():
        setattr(role, name, fn)


def selected(model: nn.Module, cfg: Fp8BaseConfig) -> list[str]:
    """The weights ``cfg.tensors`` names: exact names (what an import writes) or fnmatch patterns
    over the roles' weights (``*``: every linear and expert weight, e.g. to plan a run)."""
    candidates = sorted(fp8_candidates(model))
    out = []
    for pattern in cfg.tensors:
        out += [pattern] if not any(c in pattern for c in "*?[") else fnmatch.filter(candidates, pattern)
    return list(dict.fromkeys(out))


def keep_fp8(model: nn.Module, cfg: Fp8BaseConfig) -> None:
    """Hold the weights ``cfg.tensors`` names in FP8 on ``model`` (this pipeline stage's; a
    name matching no weight role is a one-line ConfigError)."""
    modules = dict(model.named_modules())
    ctx = model.ctx
    for name in selected(model, cfg):
        owner, attr = name.rsplit(".", 1)
        role = modules.get(owner)
        if role is None and owner.split(".")[0] == "layers" and owner.split(".")[1] not in model.layers:
            continue  # another pipeline stage's layer
        if role is None or attr not in role_weights(role):
            raise ConfigError(f"model.fp8_base.tensors: {name} is not the weight of a linear or routed-experts role")
        if record(getattr(role, attr)).stored:  # the store reads them e4m3 and brings them in dequantised
            role.fp8_block = cfg.block[1]
            continue
        _freeze(role, attr, cfg.block[1], model.groups)
        held = role.__dict__.setdefault("fp8_weights", [])
        held.append(attr)
        if len(held) == len(role_weights(role)):
            install = _install_linear if attr == "weight" else _install_experts
            install(role, ctx.backend, ctx, ctx.dtype)


@torch.no_grad()
def thaw(role: nn.Module) -> dict:
    """Turn an FP8 role back into float weights in its compute dtype (dequantised), with the
    class's own entry points: what merging an adapter into the role needs. Returns those entry
    points by name (bound), for an adapter that wraps them."""
    held = role.__dict__.pop("fp8_weights", [])
    for attr in held:
        dtype = role.weight_like().dtype
        w = _weight(role, attr, dtype, dequantize_rows)
        old = getattr(role, attr)
        for suffix in ("", "_scale", "_col_block"):
            delattr(role, attr + suffix)
        role.register_parameter(attr, nn.Parameter(w, requires_grad=False))
        getattr(role, attr)._megamoe = dataclasses.replace(record(old))
    own = {}
    for name, fn in role.__dict__.pop("fp8_entries", {}).items():
        if role.__dict__.get(name) is fn:  # an adapter wrapping the role keeps its own entry points
            del role.__dict__[name]
        if hasattr(type(role), name):
            own[name] = getattr(type(role), name).__get__(role)
    return own
