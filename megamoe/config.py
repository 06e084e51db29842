"""Typed configs, one dataclass per component.

Each component receives its own section (an attention module gets ``AttentionConfig`` and
the hidden size, never the whole recipe). ``validate()`` raises ``ConfigError`` with a
one-line message naming the field and what is allowed. Cross-component checks (heads
divisible by TP, ...) live in ``validate_model_parallel``.

No ``from __future__ import annotations`` here: OmegaConf reads these annotations at run
time to type-check YAML values.
"""
from dataclasses import dataclass, field, fields
from typing import List, Optional

from megamoe.errors import ConfigError
from megamoe.layout import MIXERS, MLPS, Layout, parse_layout

DTYPES = ("float32", "bfloat16", "float16")


def check(ok: bool, path: str, value, allowed: str) -> None:
    """Raise a one-line ConfigError unless ``ok``."""
    if not ok:
        raise ConfigError(f"{path}={value!r} is invalid: {allowed}")


def check_positive(path: str, value) -> None:
    check(isinstance(value, int) and value > 0, path, value, "must be a positive integer")


def check_choice(path: str, value, allowed) -> None:
    check(value in allowed, path, value, f"allowed: {', '.join(map(str, allowed))}")


@dataclass
class AttentionConfig:
    """Softmax attention (letters A, S, I). Shapes: q [b, t, heads, head_dim]."""

    num_heads: int = 8
    num_kv_heads: Optional[int] = None  # None: same as num_heads (MHA)
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3)
    output_gate: bool = False  # sigmoid gate on the attention output, from q_proj (Qwen3-Next)
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated
    mrope_section: Optional[List[int]] = None  # multimodal RoPE sections (t, h, w) in rotary pairs
    sliding_window: int = 0  # tokens each query sees in 'S' layers (itself included)
    softmax_scale: Optional[float] = None  # None: head_dim ** -0.5

    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def dim(self, hidden_size: int) -> int:
        return self.head_dim or hidden_size // self.num_heads

    def rotary_dim(self, hidden_size: int) -> int:
        return int(self.dim(hidden_size) * self.partial_rotary_factor)

    def validate(self, hidden_size: int, path: str = "model.attention") -> None:
        check_positive(f"{path}.num_heads", self.num_heads)
        if self.num_kv_heads is not None:
            check_positive(f"{path}.num_kv_heads", self.num_kv_heads)
            check(self.num_heads % self.num_kv_heads == 0, f"{path}.num_kv_heads", self.num_kv_heads,
                  f"must divide num_heads={self.num_heads}")
        if self.head_dim is None:
            check(hidden_size % self.num_heads == 0, f"{path}.num_heads", self.num_heads,
                  f"must divide hidden_size={hidden_size} when head_dim is not set")
        else:
            check_positive(f"{path}.head_dim", self.head_dim)
        check(0.0 < self.partial_rotary_factor <= 1.0, f"{path}.partial_rotary_factor",
              self.partial_rotary_factor, "must be in (0, 1]")
        rot = self.rotary_dim(hidden_size)
        check(rot % 2 == 0 and rot > 0, f"{path}.partial_rotary_factor", self.partial_rotary_factor,
              f"rotary dim head_dim*factor={rot} must be a positive even number")
        check(self.rope_theta > 0, f"{path}.rope_theta", self.rope_theta, "must be > 0")
        check(self.sliding_window >= 0, f"{path}.sliding_window", self.sliding_window, "must be >= 0")
        if self.mrope_section is not None:
            check(sum(self.mrope_section) * 2 == rot, f"{path}.mrope_section", self.mrope_section,
                  f"sections must sum to rotary_dim/2={rot // 2}")

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.attention") -> None:
        check(self.num_heads % parallel.tp == 0, f"{path}.num_heads", self.num_heads,
              f"must be divisible by parallel.tp={parallel.tp}")
        check(self.kv_heads() % parallel.tp == 0, f"{path}.num_kv_heads", self.kv_heads(),
              f"must be divisible by parallel.tp={parallel.tp}")


@dataclass
class MLPConfig:
    """Dense SwiGLU MLP (letter d): down(silu(gate(x)) * up(x))."""

    ffn_hidden_size: int = 2048
    bias: bool = False

    def validate(self, hidden_size: int, path: str = "model.mlp") -> None:
        check_positive(f"{path}.ffn_hidden_size", self.ffn_hidden_size)

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.mlp") -> None:
        check(self.ffn_hidden_size % parallel.tp == 0, f"{path}.ffn_hidden_size", self.ffn_hidden_size,
              f"must be divisible by parallel.tp={parallel.tp}")


@dataclass
class ModelConfig:
    """A causal language model (plus, later, its vision encoder) described by a layout string."""

    vocab_size: int = 32000
    hidden_size: int = 512
    layout: str = "AdAd"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    norm_eps: float = 1e-6
    norm_zero_centered: bool = False  # RMSNorm weight applied as (1 + w), stored zero-initialised
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    init_std: float = 0.02
    params_dtype: str = "float32"
    backend: str = "local"  # role provider: local (pure torch) or te (Transformer Engine)

    def parsed_layout(self) -> Layout:
        return parse_layout(self.layout, "model.layout")

    def validate(self, path: str = "model") -> Layout:
        check_positive(f"{path}.vocab_size", self.vocab_size)
        check_positive(f"{path}.hidden_size", self.hidden_size)
        check_positive(f"{path}.max_seq_len", self.max_seq_len)
        check(self.norm_eps > 0, f"{path}.norm_eps", self.norm_eps, "must be > 0")
        check(self.init_std > 0, f"{path}.init_std", self.init_std, "must be > 0")
        check_choice(f"{path}.params_dtype", self.params_dtype, DTYPES)
        check_choice(f"{path}.backend", self.backend, ("local", "te"))
        layout = parse_layout(self.layout, f"{path}.layout")
        self._validate_sections(layout, path)
        return layout

    def used_sections(self, layout: Layout, path: str = "model") -> dict:
        """Config sections the layout's letters need, by name; a missing one is an error.

        Every section implements ``validate(hidden_size, path)`` and
        ``validate_parallel(parallel, path)``.
        """
        used = layout.counts()
        sections = {}
        for letter, (what, section) in [*MIXERS.items(), *MLPS.items()]:
            if letter not in used or section is None or section in sections:
                continue
            sub = getattr(self, section, None)
            if sub is None:
                raise ConfigError(f"{path}.{section} is not set but {path}.layout uses '{letter}' ({what})")
            sections[section] = sub
        return sections

    def _validate_sections(self, layout: Layout, path: str) -> None:
        for name, sub in self.used_sections(layout, path).items():
            sub.validate(self.hidden_size, f"{path}.{name}")


@dataclass
class ParallelConfig:
    """Parallel degrees; dp is what is left of the world size."""

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B)
    cp: int = 1  # context parallel
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel
    sequence_parallel: bool = False  # shard activations over TP along the sequence

    def validate(self, world_size: Optional[int] = None, path: str = "parallel") -> None:
        for f in fields(self):
            if f.type is int:
                check_positive(f"{path}.{f.name}", getattr(self, f.name))
        if world_size is None:
            return
        mp = self.tp * self.pp * self.cp
        check(world_size % mp == 0, f"{path}.tp*pp*cp", mp,
              f"must divide the world size {world_size} (tp={self.tp}, pp={self.pp}, cp={self.cp})")
        emp = self.etp * self.ep * self.pp
        check(world_size % emp == 0, f"{path}.etp*ep*pp", emp,
              f"must divide the world size {world_size} (etp={self.etp}, ep={self.ep}, pp={self.pp})")

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)


def validate_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> Layout:
    """Checks that need both the model and the parallel layout."""
    layout = model.validate()
    parallel.validate()
    for name, sub in model.used_sections(layout).items():
        sub.validate_parallel(parallel, f"model.{name}")
    layout.stages(parallel.pp * parallel.vpp)
    return layout
