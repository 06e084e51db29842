"""Applying, merging and inspecting LoRA adapters on a megamoe model (or a pipeline stage of one).

    model = LanguageModel(cfg, groups); load weights ...
    apply_lora(model, LoRAConfig(rank=16, alpha=32, targets=["*"]))   # backbone + router frozen
    ... train (only the adapters have requires_grad) ...
    merge(model); unmerge(model)                                       # fold in / take out again
"""
from __future__ import annotations

import math
from fnmatch import fnmatchcase

import torch
from torch import nn

from megamoe.core.errors import CheckpointError, ConfigError
from megamoe.lora.adapters import adapter_of, attach, has_lora, is_adaptable, is_adapter_name
from megamoe.lora.config import LoRAConfig
from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.sharding import full_shape, gather_full, shard_full
from megamoe.model.fp8_base import scale_names
from megamoe.model.weights import initialize


def adaptable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear role and routed-experts role of the language model by name, in model order
    (recognised by their interface, whichever backend built them: ``megamoe.lora.adapters``).
    The vision tower (``vision.*``) is not adapted: it trains, freezes or scales its learning
    rate by ``model.vision``, and its linears are parallel ones only under
    ``model.vision.parallel.tp > 1``, which must not change what the targets select."""
    return {name: m for name, m in model.named_modules()
            if is_adaptable(m) and not (name == "vision" or name.startswith("vision."))}


def _matches(name: str, pattern: str) -> bool:
    """The pattern names the module itself or a module above it, by full name or dotted suffix."""
    return any(fnmatchcase(name, p) for p in (pattern, f"*.{pattern}", f"{pattern}.*", f"*.{pattern}.*"))


def select_targets(names: list[str], cfg: LoRAConfig, strict: bool = True) -> list[str]:
    """The module names ``cfg.targets`` selects minus ``cfg.exclude``. With ``strict``, a pattern
    matching no adaptable module is a one-line ``ConfigError``."""
    if strict:
        for field, patterns in (("targets", cfg.targets), ("exclude", cfg.exclude)):
            for pattern in patterns:
                if not any(_matches(n, pattern) for n in names):
                    examples = ", ".join(names[:3]) or "none: the model has no linear or expert module"
                    raise ConfigError(f"lora.{field}: pattern {pattern!r} matches no linear or expert module "
                                      f"(adaptable modules are e.g. {examples})")
    return [n for n in names if any(_matches(n, p) for p in cfg.targets)
            and not any(_matches(n, p) for p in cfg.exclude)]


def apply_lora(model: nn.Module, config: LoRAConfig | None = None, *, seed: int = 0,
               groups: ParallelGroups | None = None, strict: bool = True) -> nn.Module:
    """Freeze ``model`` and add adapters to the modules ``config.targets`` selects, in place.

    Every base parameter (router weights and expert bias included) gets ``requires_grad=False``;
    the adapters are drawn from (seed, name) like every parameter, so any layout starts from the
    same adapters. ``groups``: the model's (default ``model.groups``). ``strict=False`` skips the
    unmatched-pattern check (a pipeline stage may hold none of a pattern's modules; check the
    whole model with ``check_targets``). Returns the model.
    """
    config = config or LoRAConfig()
    config.validate()
    if getattr(model, "lora_config", None) is not None:
        raise ConfigError("lora: adapters are already applied to this model")
    groups = groups or getattr(model, "groups", None) or ParallelGroups()
    modules = adaptable_modules(model)
    chosen = select_targets(list(modules), config, strict)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        attach(modules[name], config, groups)
    initialize(model, groups, seed, select=is_adapter_name)
    model.lora_config = config
    return model


def check_targets(model_config, config: LoRAConfig) -> None:
    """Check ``config.targets`` against the whole model (built on the meta device): for trainers
    that apply LoRA to pipeline stages with ``strict=False``."""
    from megamoe.model.build import build_model

    with torch.device("meta"):
        model = build_model(model_config, device="meta")
    select_targets(list(adaptable_modules(model)), config, strict=True)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    out = {name: m for name, m in model.named_modules() if has_lora(m)}
    if not out:
        raise ConfigError("lora: the model has no adapters (apply_lora first)")
    return out


def merge(model: nn.Module) -> None:
    """Fold every adapter into its base weights (local pieces; no communication). The forward
    then uses the merged weights only; ``unmerge`` takes the adapters out again."""
    for m in lora_modules(model).values():
        adapter_of(m).merge()


def unmerge(model: nn.Module) -> None:
    for m in lora_modules(model).values():
        adapter_of(m).unmerge()


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if is_adapter_name(n)]


def trainable_count(parts: list[nn.Module], groups: ParallelGroups | None = None) -> tuple[int, int]:
    """(trainable, total) parameters of the full model whose pieces ``parts`` hold on this rank
    (counted as full tensors, a frozen FP8 weight's scales not: ``megamoe.model.fp8_base``; sum
    over pipeline stages yourself)."""
    groups = groups or ParallelGroups()
    trainable = total = 0
    for part in parts:
        scales = scale_names(part)
        for name, p in part.named_parameters():
            if name in scales:
                continue
            n = math.prod(full_shape(p, groups))
            total += n
            trainable += n if p.requires_grad else 0
    return trainable, total


@torch.no_grad()
def adapter_state_dict(model: nn.Module, groups: ParallelGroups | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) adapter tensors by name: a collective under a parallel layout."""
    groups = groups or getattr(model, "groups", None) or ParallelGroups()
    return {n: gather_full(p, groups).clone() for n, p in lora_parameters(model)}


@torch.no_grad()
def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor],
                            groups: ParallelGroups | None = None) -> None:
    """Copy full adapter tensors into this rank's pieces; every adapter must be present."""
    groups = groups or getattr(model, "groups", None) or ParallelGroups()
    for name, p in lora_parameters(model):
        if name not in state:
            raise CheckpointError(f"adapter state lacks tensor {name}")
        p.copy_(shard_full(state[name].to(p.dtype), p, groups))
