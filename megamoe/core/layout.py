"""Layout strings: the one description of a hybrid stack.

A layout is a sequence of layers; each layer is a mixer letter (upper case) followed by an
MLP letter (lower case)::

    Ad Ad (GeGeGeAe)*12 | (GeGeGeAe)*12

Whitespace is ignored, ``(...)*N`` repeats a group, ``|`` cuts the stack into pipeline
stages. The letters are the layout language itself, so they are defined here, in the core;
``megamoe.layers`` registers an implementation for each letter.
"""
from __future__ import annotations

from dataclasses import dataclass

from megamoe.core.errors import ConfigError

# No model is near this deep (the largest have ~100 layers); the bound stops a typo such as
# '(GeAd)*20000000' before the parser builds tens of millions of layers.
MAX_LAYERS = 10_000

# letter -> (name, config section of ModelConfig that parameterises it)
MIXERS: dict[str, tuple[str, str]] = {
    "A": ("softmax attention (GQA)", "attention"),
    "S": ("sliding-window softmax attention", "attention"),
    "B": ("block-sparse softmax attention chosen by a block-pooled indexer (MiniMax-M3)", "attention"),
    "G": ("gated DeltaNet", "gdn"),
    "K": ("Kimi delta attention (KDA)", "kda"),
    "L": ("lightning attention", "lightning"),
    "M": ("multi-head latent attention (MLA)", "mla"),
    "D": ("MLA with DeepSeek sparse attention (DSA)", "mla"),
    "I": ("MLA with pooled DeepSeek sparse attention (GLM-5 indexed)", "mla"),
    "R": ("MLA with DSA reusing the selection of the previous D layer (GLM-5 shared indexer)", "mla"),
    "W": ("sliding-window attention with sinks (DeepSeek-V4)", "compressed"),
    "C": ("compressed sparse attention (DeepSeek-V4 CSA)", "compressed"),
    "H": ("heavily compressed attention (DeepSeek-V4 HCA)", "compressed"),
}
MLPS: dict[str, tuple[str, str | None]] = {
    "d": ("dense SwiGLU MLP", "mlp"),
    "e": ("mixture of experts", "moe"),
    "h": ("hash-routed mixture of experts (DeepSeek-V4)", "moe"),
    "n": ("no MLP", None),
}

MOE_LETTERS = "eh"  # MLP letters whose layer routes tokens to experts (section moe)


@dataclass(frozen=True)
class LayerKind:
    mixer: str  # one of MIXERS
    mlp: str  # one of MLPS

    def __str__(self) -> str:
        return self.mixer + self.mlp


@dataclass(frozen=True)
class Layout:
    """A parsed layout: ``layers`` in order and the pipeline ``stages`` as layer-index lists."""

    text: str
    layers: tuple[LayerKind, ...]
    cuts: tuple[int, ...]  # layer indices where a new stage starts (after a '|')

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def stages(self, num_stages: int = 1, balanced: bool = False) -> list[list[int]]:
        """Layer indices per pipeline stage.

        With explicit cuts the number of stages must equal ``num_stages`` (a single stage
        ignores the cuts, so one recipe runs with and without pipelining); without cuts the
        layers are split evenly, which requires divisibility, unless ``balanced`` (decoding an HF
        checkpoint, which has no cuts): then the first ``n % num_stages`` stages get one more.
        """
        n = self.num_layers
        if num_stages == 1:
            return [list(range(n))]
        if self.cuts:
            bounds = [0, *self.cuts, n]
            if len(bounds) - 1 != num_stages:
                raise ConfigError(
                    f"model.layout has {len(bounds) - 1} pipeline stages ('|' cuts) but "
                    f"parallel.pp*vpp={num_stages}")
            return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
        if n % num_stages and balanced and n >= num_stages:
            sizes = [n // num_stages + (i < n % num_stages) for i in range(num_stages)]
            starts = [sum(sizes[:i]) for i in range(num_stages)]
            return [list(range(a, a + k)) for a, k in zip(starts, sizes)]
        if n % num_stages:
            raise ConfigError(
                f"model.layout has {n} layers and no '|' cuts; {n} layers do not split evenly "
                f"into parallel.pp*vpp={num_stages} stages (add '|' cuts)")
        per = n // num_stages
        return [list(range(i * per, (i + 1) * per)) for i in range(num_stages)]

    def counts(self) -> dict[str, int]:
        """How many layers use each mixer and MLP letter."""
        out: dict[str, int] = {}
        for kind in self.layers:
            out[kind.mixer] = out.get(kind.mixer, 0) + 1
            out[kind.mlp] = out.get(kind.mlp, 0) + 1
        return out

    def compact(self) -> str:
        """Layer kinds joined, stages separated by '|', without repetition groups."""
        parts, cuts = [], set(self.cuts)
        for i, kind in enumerate(self.layers):
            if i in cuts:
                parts.append("|")
            parts.append(str(kind))
        return "".join(parts)


class _Parser:
    """Recursive-descent parser that reports the position of the first bad character."""

    def __init__(self, text: str, field: str):
        self.text, self.field, self.pos = text, field, 0

    def fail(self, why: str, pos: int | None = None) -> ConfigError:
        p = self.pos if pos is None else pos
        return ConfigError(f"{self.field}={self.text!r} at position {p}: {why}")

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def sequence(self, closing: str = "") -> list:
        """items: list of LayerKind or '|'"""
        items: list = []
        while True:
            ch = self.peek()
            if ch == closing:
                return items
            if ch == "":
                raise self.fail(f"missing '{closing}'")
            if ch == "|":
                items.append("|")
                self.pos += 1
            elif ch == "(":
                items.extend(self.group())
            elif ch in MIXERS:
                items.append(self.layer())
            elif ch.isalpha() and ch.isupper():
                raise self.fail(f"unknown mixer letter {ch!r} (allowed: {', '.join(MIXERS)})")
            elif ch == ")":
                raise self.fail("unmatched ')'")
            else:
                raise self.fail(f"unexpected {ch!r} (expected a mixer letter {''.join(MIXERS)}, '(' or '|')")

    def layer(self) -> LayerKind:
        mixer = self.text[self.pos]
        self.pos += 1
        mlp = self.text[self.pos] if self.pos < len(self.text) else ""
        if mlp not in MLPS:
            shown = repr(mlp) if mlp else "end of string"
            raise self.fail(f"mixer {mixer!r} must be followed by an MLP letter "
                            f"({', '.join(MLPS)}), got {shown}")
        self.pos += 1
        return LayerKind(mixer, mlp)

    def group(self) -> list:
        start = self.pos
        self.pos += 1
        body = self.sequence(closing=")")
        self.pos += 1  # ')'
        if not any(isinstance(x, LayerKind) for x in body):
            raise self.fail("empty group", start)
        if self.peek() != "*":
            raise self.fail("a group must be followed by '*N'")
        self.pos += 1
        self.skip_space()
        digits_at = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isdigit():
            self.pos += 1
        if digits_at == self.pos:
            raise self.fail("expected a repeat count after '*'")
        count = int(self.text[digits_at:self.pos])
        if count < 1:
            raise self.fail("repeat count must be >= 1", digits_at)
        layers = sum(isinstance(x, LayerKind) for x in body)
        if layers * count > MAX_LAYERS:
            raise self.fail(f"{layers} layer(s) repeated {count} times is {layers * count:,} layers, more than "
                            f"megamoe's limit of {MAX_LAYERS:,}", digits_at)
        return body * count


def parse_layout(text: str, field: str = "model.layout") -> Layout:
    """Parse and validate a layout string; errors name ``field`` and the position."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{field} is empty: give one mixer+MLP letter pair per layer, e.g. 'AdAd'")
    parser = _Parser(text, field)
    items = parser.sequence()
    layers: list[LayerKind] = []
    cuts: list[int] = []
    for item in items:
        if item == "|":
            if not layers or (cuts and cuts[-1] == len(layers)):
                raise ConfigError(f"{field}={text!r}: a pipeline stage ('|') is empty")
            cuts.append(len(layers))
        else:
            layers.append(item)
    if cuts and cuts[-1] == len(layers):
        raise ConfigError(f"{field}={text!r}: a pipeline stage ('|') is empty")
    return Layout(text=text, layers=tuple(layers), cuts=tuple(cuts))
