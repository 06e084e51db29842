"""Declarative mapping tables between HF checkpoints and megamoe models.

A family's table is a list of rules. Each rule names one megamoe tensor pattern and the HF
tensor pattern(s) it is made of, with a typed transform both ways:

    Same("embedding.weight", "model.embed_tokens.weight")
    Cat("layers.{L}.mlp.linear_fc1.weight", ("model.layers.{L}.mlp.gate_proj.weight",
                                             "model.layers.{L}.mlp.up_proj.weight"), when="d")
    Fn(...)        any pair of functions (fused QKV, GDN interleaves, conv layouts)
    Experts(...)   per-expert HF tensors ({E}) or HF's stacked tensors <-> megamoe's [E, ...]
    OneOf(a, b)    the same tensor from alternative HF layouts (hub names or transformers' own)
    Copies(...)    a rule's tensor also stored under other names (MTP layers' copies of the
                   shared embedding and head): equal on import, written to every name

``{L}`` is a layer index, ``when`` restricts a rule to layers whose mixer or MLP letter is in
it (``""``: not a layer tensor). ``{D}`` is a multi-token-prediction depth (``megamoe.model.mtp``):
such a rule is expanded for every depth whose layer kind ``when`` allows (``""``: all), with
``{L}`` the depth's layer number (``num_layers + D``, as the HF checkpoints number it).
``renamed`` re-targets a rule (e.g. a family's layer rules at the MTP depths' layers).
``expand`` turns a table into concrete entries for one model; ``check_plan`` proves it covers
the model exactly and consumes every HF tensor.
Transforms are plain torch, so they also run on meta tensors: shapes are checked before a
byte is read.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megamoe.core.config import ModelConfig
from megamoe.core.errors import CheckpointError


@dataclass
class Ctx:
    """What a transform may look at: the model config, the HF config, the layer index."""

    cfg: ModelConfig
    hf: dict
    layer: int | None = None
    depth: int | None = None  # the multi-token-prediction depth of a ``{D}`` rule
    stacked: bool = False  # experts: the HF checkpoint holds stacked (not per-expert) tensors
    variant: int = 0  # OneOf: the index of the HF layout found in the checkpoint
    copies: list = field(default_factory=list)  # Copies: the copies' names found in the checkpoint


@dataclass(frozen=True)
class Rule(ABC):
    mm: str
    hf: tuple[str, ...]
    when: str = ""

    def hf_names(self, ctx: Ctx, available: set[str]) -> list[str]:
        return [fmt(p, ctx) for p in self.hf]

    @abstractmethod
    def to_mm(self, tensors: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        """HF tensors (in ``hf_names`` order) -> the megamoe tensor."""

    @abstractmethod
    def to_hf(self, tensor: torch.Tensor, ctx: Ctx) -> list[torch.Tensor]:
        """The megamoe tensor -> HF tensors (in ``hf_names`` order, per-expert for experts)."""


def fmt(pattern: str, ctx: Ctx, expert: int | None = None) -> str:
    out = pattern.replace("{L}", str(ctx.layer)) if ctx.layer is not None else pattern
    out = out.replace("{D}", str(ctx.depth)) if ctx.depth is not None else out
    return out.replace("{E}", str(expert)) if expert is not None else out


def Same(mm: str, hf: str, when: str = "") -> Rule:  # noqa: N802  (reads like a table row)
    return _Same(mm, (hf,), when)


@dataclass(frozen=True)
class _Same(Rule):
    def to_mm(self, tensors, ctx):
        return tensors[0]

    def to_hf(self, tensor, ctx):
        return [tensor]


@dataclass(frozen=True)
class Cat(Rule):
    """megamoe tensor = HF tensors concatenated along ``dim`` (gate|up, q|k|v parts).

    ``sizes(ctx)`` gives the parts' sizes for the way back (defaults to equal parts)."""

    dim: int = 0
    sizes: Callable[[Ctx], Sequence[int]] | None = None

    def to_mm(self, tensors, ctx):
        return torch.cat(tensors, dim=self.dim)

    def to_hf(self, tensor, ctx):
        n = len(self.hf)
        sizes = list(self.sizes(ctx)) if self.sizes else [tensor.size(self.dim) // n] * n
        return list(tensor.split(sizes, dim=self.dim))


@dataclass(frozen=True)
class Fn(Rule):
    """Arbitrary typed transform: ``forward(hf_tensors, ctx) -> mm``, ``backward(mm, ctx) -> hf list``."""

    forward: Callable = None
    backward: Callable = None

    def to_mm(self, tensors, ctx):
        return self.forward(tensors, ctx)

    def to_hf(self, tensor, ctx):
        out = self.backward(tensor, ctx)
        return list(out) if isinstance(out, (tuple, list)) else [out]


@dataclass(frozen=True)
class Experts(Rule):
    """Stacked routed-expert weights ``[E, ...]`` from HF per-expert tensors (``hf`` patterns
    with ``{E}``, the format ``save_pretrained`` writes by default) or from HF's stacked tensors
    (``stacked`` patterns, written with ``save_original_format=False``). Both load; exports
    use the per-expert format.

    ``per_expert(tensors, ctx) -> [...]`` combines one expert's HF tensors (e.g. cat gate, up),
    ``split_expert(t, ctx) -> list`` is its inverse; ``from_stacked``/``to_stacked`` likewise
    for the stacked HF tensors (default: identity on a single tensor).

    ``row_blocks``: ``per_expert`` only stacks one expert's HF tensors by rows as they are (gate
    then up; down alone) and the stacked tensors are megamoe's as they are, so a reader may take
    an expert's slices from the HF files directly (``megamoe.expert_store.hf``, tiered experts).
    """

    stacked: tuple[str, ...] = ()
    row_blocks: bool = False
    per_expert: Callable = None
    split_expert: Callable = None
    from_stacked: Callable | None = None
    to_stacked: Callable | None = None
    num_experts: Callable[[Ctx], int] = lambda ctx: ctx.cfg.moe.num_experts

    def hf_names(self, ctx, available):
        ctx.stacked = bool(self.stacked) and all(fmt(p, ctx) in available for p in self.stacked)
        if ctx.stacked:
            return [fmt(p, ctx) for p in self.stacked]
        return [fmt(p, ctx, e) for e in range(self.num_experts(ctx)) for p in self.hf]

    def to_mm(self, tensors, ctx):
        if ctx.stacked:
            return self.from_stacked(tensors, ctx) if self.from_stacked else tensors[0]
        n, k = self.num_experts(ctx), len(self.hf)
        return torch.stack([self.per_expert(tensors[e * k:(e + 1) * k], ctx) for e in range(n)])

    def to_hf(self, tensor, ctx):
        out = []
        for e in range(tensor.size(0)):
            out += list(self.split_expert(tensor[e], ctx))
        return out

    def to_hf_stacked(self, tensor, ctx):
        return list(self.to_stacked(tensor, ctx)) if self.to_stacked else [tensor]


@dataclass(frozen=True)
class Copies(Rule):
    """``rule``'s tensor (one HF tensor) also stored under the names in ``hf`` (DeepSeek-V3's MTP
    layers carry copies of the embedding and head they share with the model). Import reads the
    copies the checkpoint holds and checks they equal the tensor bitwise, so keeping one loses
    nothing; export writes it under every name."""

    rule: Rule = None

    def hf_names(self, ctx, available):
        copies = [fmt(p, ctx) for p in self.hf]
        ctx.copies = [n for n in copies if n in available] if available else copies  # export: all of them
        return [*self.rule.hf_names(ctx, available), *ctx.copies]

    def to_mm(self, tensors, ctx):
        first = self.rule.to_mm(tensors[:1], ctx)
        for name, t in zip(ctx.copies, tensors[1:]):
            if t.shape != first.shape or not (first.is_meta or t.is_meta or torch.equal(t, first)):
                raise CheckpointError(f"tensor {name} differs from the model's {self.mm}: megamoe keeps one "
                                      f"{self.mm}, shared by the model and its multi-token-prediction layers")
        return first

    def to_hf(self, tensor, ctx):
        return [*self.rule.to_hf(tensor, ctx), *[tensor] * len(ctx.copies)]


def OneOf(*rules: Rule) -> Rule:  # noqa: N802  (reads like a table row)
    """One megamoe tensor from whichever of several HF layouts the checkpoint holds.

    ``rules[0]`` is the layout ``save_pretrained`` writes by default (the hub checkpoint's names,
    e.g. kimi_linear's ``self_attn.q_conv1d``/``k_conv1d``/``v_conv1d``); exports write it. Later
    rules are accepted on import, e.g. transformers' in-memory names written with
    ``save_original_format=False`` (``self_attn.conv1d``). The first rule whose HF tensors are
    all present is used; when none is complete, the first one's missing tensor is reported.
    """
    if not rules or any(r.mm != rules[0].mm or r.when != rules[0].when for r in rules):
        raise ValueError(f"OneOf: rules must produce the same tensor under the same layers, got "
                         f"{[(r.mm, r.when) for r in rules]}")
    return _OneOf(rules[0].mm, rules[0].hf, rules[0].when, tuple(rules))


def alternatives(original: list[Rule], *others: list[Rule]) -> list[Rule]:
    """Rule groups written once per HF layout (same tensors, same order) -> one rule per tensor,
    a ``OneOf`` where the layouts differ."""
    groups = list(zip(original, *others, strict=True))
    return [rules[0] if all(r == rules[0] for r in rules) else OneOf(*rules) for rules in groups]


@dataclass(frozen=True)
class _OneOf(Rule):
    rules: tuple[Rule, ...] = ()

    def hf_names(self, ctx, available):
        for i, rule in enumerate(self.rules):
            names = rule.hf_names(ctx, available)  # may set ctx.stacked (Experts): the chosen rule's stays
            if all(n in available for n in names):
                ctx.variant = i
                return names
        ctx.variant = 0
        return self.rules[0].hf_names(ctx, available)

    def to_mm(self, tensors, ctx):
        return self.rules[ctx.variant].to_mm(tensors, ctx)

    def to_hf(self, tensor, ctx):
        return self.rules[ctx.variant].to_hf(tensor, ctx)


def renamed(rule: Rule, mm: Callable[[str], str], hf: Callable[[str], str]) -> Rule:
    """``rule`` with its megamoe pattern mapped by ``mm`` and every HF pattern (alternatives and
    stacked experts included) by ``hf``; transforms unchanged."""
    changes = {"mm": mm(rule.mm), "hf": tuple(hf(p) for p in rule.hf)}
    if isinstance(rule, Experts):
        changes["stacked"] = tuple(hf(p) for p in rule.stacked)
    if isinstance(rule, _OneOf):
        changes["rules"] = tuple(renamed(r, mm, hf) for r in rule.rules)
    if isinstance(rule, Copies):
        changes["rule"] = renamed(rule.rule, mm, hf)
    return dataclasses.replace(rule, **changes)


# ---- expansion and checks ----------------------------------------------------------------

@dataclass
class Entry:
    """One megamoe tensor and the HF tensors it is made of."""

    mm: str
    hf: list[str]
    rule: Rule
    ctx: Ctx = field(repr=False)

    def to_mm(self, tensors):
        return self.rule.to_mm(tensors, self.ctx)

    def to_hf(self, tensor):
        return self.rule.to_hf(tensor, self.ctx)


def layer_matches(rule: Rule, kind) -> bool:
    return kind.mixer in rule.when or kind.mlp in rule.when


def expand(rules: list[Rule], cfg: ModelConfig, hf: dict, available: set[str] | None = None,
           num_layers: int | None = None) -> list[Entry]:
    """Concrete entries for every layer of ``cfg`` (HF names as found in ``available``)."""
    layout = cfg.parsed_layout()
    depths = cfg.mtp.kinds() if cfg.mtp is not None else ()
    available = available or set()
    out: list[Entry] = []
    for rule in rules:
        if "{D}" in rule.mm:
            contexts = [Ctx(cfg, hf, layout.num_layers + d, depth=d) for d, kind in enumerate(depths)
                        if not rule.when or layer_matches(rule, kind)]
        elif "{L}" in rule.mm:
            contexts = [Ctx(cfg, hf, i) for i, kind in enumerate(layout.layers) if layer_matches(rule, kind)]
        else:
            contexts = [Ctx(cfg, hf)]
        out += [Entry(fmt(rule.mm, ctx), rule.hf_names(ctx, available), rule, ctx) for ctx in contexts]
    return out


def check_plan(entries: list[Entry], model_shapes: dict[str, tuple], hf_shapes: dict[str, tuple] | None,
               source: str) -> None:
    """The plan covers every model tensor once; every HF tensor it needs exists with a shape
    that transforms into the model's; nothing in the HF checkpoint is left unmapped."""
    by_mm: dict[str, Entry] = {}
    for e in entries:
        if e.mm in by_mm:
            raise CheckpointError(f"mapping table: megamoe tensor {e.mm} is produced by two rules")
        if e.mm not in model_shapes:
            raise CheckpointError(f"mapping table: rule for {e.mm} matches no tensor of the model")
        by_mm[e.mm] = e
    missing = [n for n in model_shapes if n not in by_mm]
    if missing:
        raise CheckpointError(f"mapping table: model tensor {missing[0]} has no rule ({len(missing)} unmapped)")
    if hf_shapes is None:
        return
    used = set()
    for e in entries:
        for name in e.hf:
            if name not in hf_shapes:
                raise CheckpointError(f"{source}: tensor {name} (for {e.mm}) is missing")
        used.update(e.hf)
        metas = [torch.empty(hf_shapes[n], device="meta") for n in e.hf]
        try:
            got = tuple(e.to_mm(metas).shape)
        except Exception as err:  # noqa: BLE001  (a transform that cannot apply is a shape error)
            shapes = ", ".join(f"{n} {list(hf_shapes[n])}" for n in e.hf)
            raise CheckpointError(f"{source}: shapes {shapes} do not fit {e.mm} ({err})") from None
        if got != tuple(model_shapes[e.mm]):
            raise CheckpointError(f"{source}: {e.hf[0]} gives {e.mm} of shape {list(got)}, "
                                  f"the model expects {list(model_shapes[e.mm])}")
    extra = sorted(set(hf_shapes) - used)
    if extra:
        raise CheckpointError(f"{source}: tensor {extra[0]} is not mapped to the model "
                              f"({len(extra)} unmapped; config and weights disagree?)")
