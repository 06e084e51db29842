"""Specs: data that points at classes, and the registries keyed by layout letter.

A spec holds no control flow. ``megamoe.layers`` registers one spec per mixer letter and
MLP letter (see ``megamoe.core.layout`` for the letters); model assembly looks them up.

Every block is constructed as ``cls(config_section, ctx, layer_number, **spec.params)``:
its own config section, the ``BuildContext`` (groups, backend, dims shared by all blocks)
and its 0-based layer number.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megamoe.core.errors import ConfigError
from megamoe.parallel.groups import ParallelGroups


@dataclass(frozen=True)
class ModuleSpec:
    module: type
    params: dict = field(default_factory=dict)
    submodules: Any = None


def build_module(spec: ModuleSpec, *args, **kwargs):
    kw = dict(spec.params)
    kw.update(kwargs)
    if spec.submodules is not None:
        kw["submodules"] = spec.submodules
    return spec.module(*args, **kw)


@dataclass
class BuildContext:
    """What every block needs besides its own config section."""

    hidden_size: int
    groups: ParallelGroups = field(default_factory=ParallelGroups)
    backend: Any = None  # a megamoe.layers.backends instance; filled by model assembly
    sequence_parallel: bool = False
    norm_eps: float = 1e-6
    norm_zero_centered: bool = False
    init_std: float = 0.02
    num_layers: int = 1
    dtype: torch.dtype = torch.float32
    device: Any = None
    vocab_size: int = 0  # the token ids' range (hash-routed MoE layers keep a table over it)

    @property
    def sp(self) -> bool:
        """Sequence parallelism is active (enabled and TP > 1)."""
        return self.sequence_parallel and self.groups.tp_size > 1


@dataclass
class ForwardInfo:
    """Per-forward inputs shared by all blocks.

    positions: [b, s] token positions (or [3, b, s] for multimodal RoPE), full sequence even
    under sequence parallelism, and this rank's tokens only under context parallelism; cache: a
    decode cache (None in training); memo: per-forward memo for values several layers share
    (e.g. rotary tables keyed by their parameters); cp: this rank's share of the sequence under
    context parallelism (``megamoe.parallel.context.ContextShard``; None without CP); documents:
    [b, S] document number of every token of packed sequences, full sequence in global order
    (None: one document per sequence); token_ids: [b, s] the input ids of this rank's tokens (cut
    like positions under CP, not under SP), for layers that route by token (hash-routed MoE).
    """

    positions: torch.Tensor
    cache: Any = None
    memo: dict = field(default_factory=dict)
    cp: Any = None
    documents: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None


MIXER_SPECS: dict[str, ModuleSpec] = {}
MLP_SPECS: dict[str, ModuleSpec] = {}


def register_mixer(letter: str, spec: ModuleSpec) -> None:
    MIXER_SPECS[letter] = spec


def register_mlp(letter: str, spec: ModuleSpec) -> None:
    MLP_SPECS[letter] = spec


def mixer_spec(letter: str) -> ModuleSpec:
    if letter not in MIXER_SPECS:
        raise ConfigError(f"model.layout: mixer letter {letter!r} has no implementation registered yet")
    return MIXER_SPECS[letter]


def mlp_spec(letter: str) -> ModuleSpec:
    if letter not in MLP_SPECS:
        raise ConfigError(f"model.layout: MLP letter {letter!r} has no implementation registered yet")
    return MLP_SPECS[letter]
