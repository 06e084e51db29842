"""Typed configs, one dataclass per component.

Each component receives its own section (an attention module gets ``AttentionConfig`` and
the hidden size, never the whole recipe). ``validate()`` raises ``ConfigError`` with a
one-line message naming the field and what is allowed. Cross-component checks (heads
divisible by TP, ...) live in ``validate_model_parallel``.

No ``from __future__ import annotations`` here: OmegaConf reads these annotations at run
time to type-check YAML values.
"""
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from megamoe.core.dtypes import DTYPES
from megamoe.core.errors import ConfigError
from megamoe.core.layout import MIXERS, MLPS, MOE_LETTERS, LayerKind, Layout, parse_layout
from megamoe.core.placement import check_placement, check_replicas, default_replicas, layer_entry, router_index

FUSION_MODES = ("auto", "on", "off")  # megamoe.layers.ops.fusion.Fusion's modes (a backend's policy)



def check(ok: bool, path: str, value, allowed: str) -> None:
    """Raise a one-line ConfigError unless ``ok``."""
    if not ok:
        raise ConfigError(f"{path}={value!r} is invalid: {allowed}")


def check_positive(path: str, value) -> None:
    check(isinstance(value, int) and value > 0, path, value, "must be a positive integer")


def check_choice(path: str, value, allowed) -> None:
    check(value in allowed, path, value, f"allowed: {', '.join(map(str, allowed))}")


@dataclass
class YarnConfig:
    """YaRN RoPE scaling, as HF ``rope_type: yarn`` (DeepSeek-V3, Qwen3, GLM configs); factor 1 = off.
    ``model.attention.yarn`` (A, S) and ``model.mla.yarn`` (M, D, R, I).

    original_max_position: pre-training length; beta_fast / beta_slow: rotation counts that
    bound the interpolation ramp; mscale / mscale_all_dim: attention temperature terms
    ``0.1 * m * ln(factor) + 1`` (cos/sin; MLA also scales its softmax by mscale_all_dim's, as
    DeepSeek does). mscale 0 stands for "not set" (HF then scales cos/sin by mscale(factor, 1)).
    """

    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def validate(self, path: str = "model.mla.yarn") -> None:
        check(self.factor >= 1.0, f"{path}.factor", self.factor, "must be >= 1 (1 = off)")
        check_positive(f"{path}.original_max_position", self.original_max_position)
        check(self.beta_fast > self.beta_slow > 0, f"{path}.beta_fast", self.beta_fast,
              f"must be > beta_slow={self.beta_slow} > 0")


@dataclass
class BlockIndexConfig:
    """MiniMax-M3's block-pooled lightning indexer (letter B), section ``attention.block_index``.

    Per query and KV group, keys are scored by ``num_heads`` light heads (one per KV group),
    max-pooled into blocks of ``block_size`` keys; the attention sees the ``local_blocks``
    blocks ending at the query's own and the best others, ``topk_blocks`` blocks in all.
    """

    num_heads: int = 4  # HF index_n_heads (= the KV heads)
    head_dim: int = 128  # HF index_head_dim
    block_size: int = 128  # HF index_block_size (keys)
    topk_blocks: int = 16  # HF index_topk_blocks
    local_blocks: int = 1  # HF index_local_blocks

    def validate(self, path: str = "model.attention.block_index") -> None:
        for name in ("num_heads", "head_dim", "block_size", "topk_blocks"):
            check_positive(f"{path}.{name}", getattr(self, name))
        check(isinstance(self.local_blocks, int) and 0 <= self.local_blocks <= self.topk_blocks,
              f"{path}.local_blocks", self.local_blocks, f"must be in [0, topk_blocks={self.topk_blocks}]")


@dataclass
class AttentionConfig:
    """Softmax attention (letters A, S). Shapes: q [b, t, heads, head_dim]."""

    num_heads: int = 8
    num_kv_heads: Optional[int] = None  # None: same as num_heads (MHA)
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    qk_norm: bool = False  # RMSNorm on q and k (Qwen3)
    qk_norm_scope: str = "head"  # the QK-norm's span: head (each head's head_dim) | all (all heads at once, MiniMax-M2)
    output_gate: bool = False  # sigmoid gate on the attention output, from q_proj (Qwen3-Next)
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated
    mrope_section: Optional[List[int]] = None  # multimodal RoPE sections (t, h, w) in rotary pairs
    sliding_window: int = 0  # tokens each query sees in 'S' layers (itself included)
    softmax_scale: Optional[float] = None  # None: head_dim ** -0.5
    yarn: YarnConfig = field(default_factory=YarnConfig)  # YaRN RoPE scaling (factor 1 = off)
    block_index: Optional[BlockIndexConfig] = None  # required by B layers (MiniMax-M3 block-sparse attention)

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
        check_choice(f"{path}.qk_norm_scope", self.qk_norm_scope, ("head", "all"))
        if self.mrope_section is not None:
            check(sum(self.mrope_section) * 2 == rot, f"{path}.mrope_section", self.mrope_section,
                  f"sections must sum to rotary_dim/2={rot // 2}")
        self.yarn.validate(f"{path}.yarn")
        if self.block_index is not None:
            self.block_index.validate(f"{path}.block_index")
            check(self.block_index.num_heads == self.kv_heads(), f"{path}.block_index.num_heads",
                  self.block_index.num_heads, f"must equal num_kv_heads={self.kv_heads()} (one selection per KV group)")
            check(self.block_index.head_dim >= rot, f"{path}.block_index.head_dim", self.block_index.head_dim,
                  f"must be >= the rotary dim {rot} (the indexer rotates that many channels)")
        check(self.yarn.factor == 1 or self.mrope_section is None, f"{path}.yarn.factor", self.yarn.factor,
              "must be 1 with mrope_section (YaRN with multimodal RoPE is not supported)")

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.attention") -> None:
        check(self.num_heads % parallel.tp == 0, f"{path}.num_heads", self.num_heads,
              f"must be divisible by parallel.tp={parallel.tp}")
        check(self.kv_heads() % parallel.tp == 0, f"{path}.num_kv_heads", self.kv_heads(),
              f"must be divisible by parallel.tp={parallel.tp}")


def check_swiglu(path: str, limit, alpha) -> None:
    check(limit is None or limit > 0, f"{path}.swiglu_limit", limit, "must be > 0 (or null for no clamp)")
    check(alpha is None or alpha > 0, f"{path}.swiglu_alpha", alpha, "must be > 0 (or null for plain SwiGLU)")


@dataclass
class MLPConfig:
    """Dense SwiGLU MLP (letter d): down(silu(gate(x)) * up(x)), or SwiGLU-OAI with
    ``swiglu_alpha``: down(gate * sigmoid(alpha * gate) * (up + 1)) (megamoe.layers.mlp.dense)."""

    ffn_hidden_size: int = 2048
    bias: bool = False
    swiglu_limit: Optional[float] = None  # clamp gate to <= limit, up to [-limit, limit] before SwiGLU (GLM-5)
    swiglu_alpha: Optional[float] = None  # SwiGLU-OAI's sigmoid gain (MiniMax-M3: 1.702); None: plain SwiGLU

    def validate(self, hidden_size: int, path: str = "model.mlp") -> None:
        check_positive(f"{path}.ffn_hidden_size", self.ffn_hidden_size)
        check_swiglu(path, self.swiglu_limit, self.swiglu_alpha)

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.mlp") -> None:
        check(self.ffn_hidden_size % parallel.tp == 0, f"{path}.ffn_hidden_size", self.ffn_hidden_size,
              f"must be divisible by parallel.tp={parallel.tp}")


@dataclass
class VisionParallelConfig:
    """How the vision encoder is spread over ranks, separately from the language model.

    mode ``replicated``: every rank of the LM's tensor-parallel group encodes all images of its
    batch; ``split``: the images of a batch are divided over that group (balanced by patch
    count) and the projected features all-gathered, so each rank encodes about 1/tp of them.
    ``tp``: 1, or the LM's ``parallel.tp`` to split every attention and MLP block of the
    encoder over that group (Megatron-style, ``megamoe.vision.tensor_parallel``; mode
    ``replicated``: the ranks of the group cooperate on every image).
    """

    mode: str = "replicated"
    tp: int = 1

    def validate(self, path: str = "model.vision.parallel") -> None:
        check_choice(f"{path}.mode", self.mode, ("replicated", "split"))
        check_positive(f"{path}.tp", self.tp)
        check(self.tp == 1 or self.mode == "replicated", f"{path}.mode", self.mode,
              f"must be replicated with tp={self.tp} (the encoder's tensor-parallel ranks share every image)")

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.vision.parallel") -> None:
        check(self.tp in (1, parallel.tp), f"{path}.tp", self.tp,
              f"must be 1 or the language model's parallel.tp={parallel.tp} (the encoder splits over its group)")


@dataclass
class ImageBoundsConfig:
    """Image preprocessing bounds (see docs/vision.md).

    resize ``dynamic``: keep the aspect ratio, sides multiples of ``patch_multiple``, pixel count
    within [min_pixels, max_pixels] (Qwen's smart resize); ``fixed``: squash to the encoder's
    pretrained input size; ``auto``: dynamic when the encoder accepts any size, else fixed.
    Raw images outside [``min_input_pixels``, ``max_input_pixels``] (checked from the header,
    before decoding), with an aspect ratio over ``max_aspect_ratio``, in a PIL mode outside
    ``modes`` or animated (unless ``animated: first_frame``) are rejected with a one-line error,
    in training data as in preprocessing (``megamoe.core.images``).
    """

    resize: str = "auto"
    min_pixels: int = 32 * 32
    max_pixels: int = 1024 * 1024
    patch_multiple: Optional[int] = None  # None: encoder patch size x projector merge size
    max_aspect_ratio: float = 200.0
    max_input_pixels: int = 89_478_485  # PIL's decompression-bomb limit
    min_input_pixels: int = 1
    modes: List[str] = field(default_factory=lambda: ["RGB", "RGBA", "L", "LA", "P"])
    animated: str = "refuse"  # refuse | first_frame (animated GIF/PNG/WebP)

    def validate(self, path: str = "model.vision.bounds") -> None:
        check_choice(f"{path}.resize", self.resize, ("auto", "dynamic", "fixed"))
        check_positive(f"{path}.min_pixels", self.min_pixels)
        check_positive(f"{path}.max_pixels", self.max_pixels)
        check(self.max_pixels >= self.min_pixels, f"{path}.max_pixels", self.max_pixels,
              f"must be >= min_pixels={self.min_pixels}")
        if self.patch_multiple is not None:
            check_positive(f"{path}.patch_multiple", self.patch_multiple)
            check(self.max_pixels >= self.patch_multiple ** 2, f"{path}.max_pixels", self.max_pixels,
                  f"must hold one patch_multiple^2={self.patch_multiple ** 2} block")
        check(self.max_aspect_ratio >= 1.0, f"{path}.max_aspect_ratio", self.max_aspect_ratio, "must be >= 1")
        check_positive(f"{path}.max_input_pixels", self.max_input_pixels)
        check_positive(f"{path}.min_input_pixels", self.min_input_pixels)
        check(self.max_input_pixels >= self.min_input_pixels, f"{path}.max_input_pixels", self.max_input_pixels,
              f"must be >= min_input_pixels={self.min_input_pixels}")
        check_choice(f"{path}.animated", self.animated, ("refuse", "first_frame"))
        check(len(self.modes) > 0, f"{path}.modes", self.modes, "list at least one PIL mode, e.g. RGB")


@dataclass
class VisionConfig:
    """A timm vision encoder and the projector that maps its patches to LM tokens.

    encoder: any timm model name, built offline (``encoder_args`` go to ``timm.create_model``);
    weights: optional local file (safetensors, torch) or directory of ``*.safetensors``; only
    tensors starting with ``weights_prefix`` are read, then remapped by timm's checkpoint filter
    of the model (``weights_filter``: ``auto``, ``none`` or a dotted path) and loaded strictly.
    projector ``mlp``: Linear-GELU-Linear per patch (LLaVA); ``merger``: LayerNorm, k x k patch
    merge (``merge_size``), Linear-GELU-Linear (Qwen, Kimi); ``glm_merger``: k x k strided conv,
    Linear-LayerNorm-GELU, clamped SwiGLU (GLM-5); ``mlp_merger``: ``mlp`` per patch, then
    the k x k merge and Linear-GELU-Linear (MiniMax-M3). ``image_token_id``: the placeholder token
    each projected image token replaces.
    """

    encoder: str = "vit_base_patch16_224"
    encoder_args: Dict[str, Any] = field(default_factory=dict)
    weights: Optional[str] = None
    weights_prefix: Optional[str] = None
    weights_filter: str = "auto"
    freeze: bool = False  # encoder frozen (no grads, run without autograd); the projector trains
    recompute: bool = False  # timm gradient checkpointing in the encoder blocks (memory for time)
    projector: str = "mlp"
    merge_size: int = 2  # merger, glm_merger, mlp_merger
    projector_norm_eps: float = 1e-6  # merger's / glm_merger's LayerNorm (Qwen 1e-6, Kimi-K2.5 and GLM-5 1e-5)
    projector_hidden: Optional[int] = None  # mlp, mlp_merger (None: the LM hidden size), glm_merger's SwiGLU (None: 4x)
    projector_swiglu_limit: Optional[float] = None  # glm_merger: clamp of its SwiGLU (None: none)
    # Qwen3-VL's deepstack: these encoder blocks' outputs, each through its own merger (LayerNorm
    # after the merge), are added to the LM hidden states at the image tokens after LM layer 0, 1, ...
    deepstack_layers: List[int] = field(default_factory=list)
    image_token_id: int = -1
    lr_scale: float = 1.0  # encoder learning rate = lr * lr_scale (see megamoe.model.multimodal.param_groups)
    seed: int = 0  # timm's own init is drawn under this seed, so every rank builds the same encoder
    bounds: ImageBoundsConfig = field(default_factory=ImageBoundsConfig)
    parallel: VisionParallelConfig = field(default_factory=VisionParallelConfig)

    def validate(self, hidden_size: int, path: str = "model.vision") -> None:
        check(isinstance(self.encoder, str) and bool(self.encoder), f"{path}.encoder", self.encoder,
              "name a timm model, e.g. vit_base_patch16_224")
        check_choice(f"{path}.projector", self.projector, ("mlp", "merger", "glm_merger", "mlp_merger"))
        check_positive(f"{path}.merge_size", self.merge_size)
        check(self.projector_norm_eps > 0, f"{path}.projector_norm_eps", self.projector_norm_eps, "must be > 0")
        layers = list(self.deepstack_layers)
        check(layers == sorted(set(layers)) and all(i >= 0 for i in layers), f"{path}.deepstack_layers", layers,
              "encoder block indices, ascending, each once")
        check(not layers or self.projector == "merger", f"{path}.deepstack_layers", layers,
              "deepstack mergers come with projector=merger")
        if self.projector_hidden is not None:
            check_positive(f"{path}.projector_hidden", self.projector_hidden)
        check(self.lr_scale >= 0, f"{path}.lr_scale", self.lr_scale, "must be >= 0")
        check(self.image_token_id >= 0, f"{path}.image_token_id", self.image_token_id,
              "set the id of the image placeholder token")
        self.bounds.validate(f"{path}.bounds")
        self.parallel.validate(f"{path}.parallel")

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.vision") -> None:
        self.parallel.validate(f"{path}.parallel")
        self.parallel.validate_parallel(parallel, f"{path}.parallel")


@dataclass
class LightningConfig:
    """Lightning attention, MiniMax-01 (letter L): decayed linear attention, per-head slopes.

    Shapes: q, k, v [b, t, heads, head_dim]; state [b, heads, head_dim, head_dim] in fp32.
    ``block_size`` is the training chunk length (any value gives the same result).
    """

    num_heads: int = 8
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    block_size: int = 64
    norm_eps: float = 1e-6  # the output norm over all heads (MiniMax builds it with the default eps)

    def dim(self, hidden_size: int) -> int:
        return self.head_dim or hidden_size // self.num_heads

    def validate(self, hidden_size: int, path: str = "model.lightning") -> None:
        check_positive(f"{path}.num_heads", self.num_heads)
        if self.head_dim is None:
            check(hidden_size % self.num_heads == 0, f"{path}.num_heads", self.num_heads,
                  f"must divide hidden_size={hidden_size} when head_dim is not set")
        else:
            check_positive(f"{path}.head_dim", self.head_dim)
        check_positive(f"{path}.block_size", self.block_size)
        check(self.norm_eps > 0, f"{path}.norm_eps", self.norm_eps, "must be > 0")

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.lightning") -> None:
        check(self.num_heads % parallel.tp == 0, f"{path}.num_heads", self.num_heads,
              f"must be divisible by parallel.tp={parallel.tp}")


@dataclass
class DSAConfig:
    """DeepSeek sparse attention indexer (letters D and I), section ``mla.indexer``.

    Per query, the indexer scores keys with ``num_heads`` light heads
    (``sum_h w_h * relu(q_h . k)``) and the attention sees only the ``topk`` best (causal).
    ``kpool`` and ``select_tail`` apply to ``I`` (GLM-5): keys are scored in pools of
    ``kpool`` tokens, ``topk / kpool`` pools are kept, plus the incomplete last pool.
    """

    num_heads: int = 64  # HF index_n_heads
    head_dim: int = 128  # HF index_head_dim
    topk: int = 2048  # HF index_topk (tokens)
    kpool: int = 1  # HF index_kpool ('I' layers)
    select_tail: bool = True  # HF index_kpool_always_select_tail ('I' layers)
    rope: str = "half"  # 'D' layers' indexer RoPE: half (rotate-half, DeepSeek-V3.2) | interleaved (GLM-5)

    def validate(self, hidden_size: int, path: str = "model.mla.indexer") -> None:
        for name in ("num_heads", "head_dim", "topk", "kpool"):
            check_positive(f"{path}.{name}", getattr(self, name))
        check(self.topk % self.kpool == 0, f"{path}.topk", self.topk, f"must be divisible by kpool={self.kpool}")
        check_choice(f"{path}.rope", self.rope, ("half", "interleaved"))
        check(self.kpool == 1 or self.select_tail, f"{path}.select_tail", self.select_tail,
              "must be true when kpool > 1 (else the first tokens would see no key)")


@dataclass
class MLAConfig:
    """Multi-head latent attention (letters M, D, R, I): DeepSeek-V3, Kimi, Ling, GLM-5.

    q = W_qb norm(W_qa x) (or W_q x when ``q_lora_rank`` is None); the keys/values come from a
    shared latent c = norm(W_kva x)[:kv_lora_rank] expanded per head by W_kvb, plus one
    RoPE key part k_rope shared by all heads. Heads have qk_nope + qk_rope query/key channels
    and v_head_dim value channels. ``rope``: interleaved (DeepSeek, Ling), half (rotate-half),
    none (Kimi, GLM-5: the k_rope channels are used unrotated). ``yarn``: YaRN scaling
    (factor 1 = off). ``head_gate``: per-head sigmoid output gate from x (Ling).
    """

    num_heads: int = 16
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope: str = "interleaved"
    rope_theta: float = 10000.0
    yarn: YarnConfig = field(default_factory=YarnConfig)
    head_gate: bool = False
    latent_norm_eps: Optional[float] = None  # None: model.norm_eps
    softmax_scale: Optional[float] = None  # None: (qk_nope + qk_rope) ** -0.5, times the YaRN mscale
    indexer: Optional[DSAConfig] = None  # required by D and I layers

    def validate(self, hidden_size: int, path: str = "model.mla") -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            check_positive(f"{path}.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            check_positive(f"{path}.q_lora_rank", self.q_lora_rank)
        rope = self.qk_rope_head_dim
        check(isinstance(rope, int) and rope >= 0 and rope % 2 == 0, f"{path}.qk_rope_head_dim", rope,
              "must be an even integer >= 0")
        check_choice(f"{path}.rope", self.rope, ("interleaved", "half", "none"))
        check(self.rope_theta > 0, f"{path}.rope_theta", self.rope_theta, "must be > 0")
        self.yarn.validate(f"{path}.yarn")
        if self.indexer is not None:
            self.indexer.validate(hidden_size, f"{path}.indexer")
            check(self.q_lora_rank is not None, f"{path}.q_lora_rank", self.q_lora_rank,
                  "must be set when mla.indexer is (the indexer reads the query latent)")
            check(rope <= self.indexer.head_dim, f"{path}.indexer.head_dim", self.indexer.head_dim,
                  f"must be >= qk_rope_head_dim={rope} (the indexer rotates that many channels)")

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.mla") -> None:
        check(self.num_heads % parallel.tp == 0, f"{path}.num_heads", self.num_heads,
              f"must be divisible by parallel.tp={parallel.tp}")


@dataclass
class CompressedAttentionConfig:
    """DeepSeek-V4 attention (letters W, C, H), section ``model.compressed``. HF names in brackets.

    One shared key/value head of ``head_dim`` (keys are values) seen by ``num_heads`` query heads
    from a low-rank query latent, over the last ``sliding_window`` tokens plus, for ``C``
    (compressed sparse, CSA) the ``indexer.topk`` compressed entries the lightning indexer picks
    (blocks of ``csa_rate`` tokens, overlapping by one block) and for ``H`` (heavily compressed,
    HCA) every earlier entry (blocks of ``hca_rate`` tokens); a learned sink logit per head; the
    output through a grouped low-rank projection (``o_groups`` groups of heads, ``o_lora_rank``
    each). ``W`` is the window alone. RoPE (interleaved pairs) on the last ``rope_head_dim``
    channels: base ``rope_theta`` in W layers, ``compress_rope_theta`` with ``yarn`` in C/H layers.
    Shapes: q [b, s, heads, head_dim], key/value [b, T, head_dim], entries [b, N, head_dim].
    """

    num_heads: int = 64  # [num_attention_heads]
    head_dim: int = 512  # [head_dim]
    rope_head_dim: int = 64  # [head_dim * partial_rotary_factor]
    q_lora_rank: int = 1024  # [q_lora_rank]
    o_groups: int = 8  # [o_groups]
    o_lora_rank: int = 1024  # [o_lora_rank]
    sliding_window: int = 128  # keys each query sees, itself included [sliding_window]
    rope_theta: float = 10000.0  # W layers [rope_theta]
    compress_rope_theta: float = 160000.0  # C, H layers [compress_rope_theta]
    yarn: YarnConfig = field(default_factory=YarnConfig)  # C, H layers' YaRN (factor 1 = off)
    csa_rate: int = 4  # tokens per compressed entry in C layers [compress_rates]
    hca_rate: int = 128  # tokens per compressed entry in H layers [compress_rates]
    indexer: Optional[DSAConfig] = None  # C layers: num_heads, head_dim, topk [index_n_heads, ...]
    norm_eps: Optional[float] = None  # the latent, key and entry norms; None: model.norm_eps

    def validate(self, hidden_size: int, path: str = "model.compressed") -> None:
        for name in ("num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                     "csa_rate", "hca_rate"):
            check_positive(f"{path}.{name}", getattr(self, name))
        r = self.rope_head_dim
        check(isinstance(r, int) and 0 < r <= self.head_dim and r % 2 == 0, f"{path}.rope_head_dim", r,
              f"must be an even integer in (0, head_dim={self.head_dim}]")
        check(self.num_heads % self.o_groups == 0, f"{path}.o_groups", self.o_groups,
              f"must divide num_heads={self.num_heads}")
        for name in ("rope_theta", "compress_rope_theta"):
            check(getattr(self, name) > 0, f"{path}.{name}", getattr(self, name), "must be > 0")
        self.yarn.validate(f"{path}.yarn")
        check(self.norm_eps is None or self.norm_eps > 0, f"{path}.norm_eps", self.norm_eps, "must be > 0")
        if self.indexer is not None:
            self.indexer.validate(hidden_size, f"{path}.indexer")
            check(r <= self.indexer.head_dim, f"{path}.indexer.head_dim", self.indexer.head_dim,
                  f"must be >= rope_head_dim={r} (the indexer rotates that many channels)")

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.compressed") -> None:
        check(self.num_heads % parallel.tp == 0, f"{path}.num_heads", self.num_heads,
              f"must be divisible by parallel.tp={parallel.tp}")
        check(self.o_groups % parallel.tp == 0, f"{path}.o_groups", self.o_groups,
              f"must be divisible by parallel.tp={parallel.tp} (a rank projects its own groups of heads)")


def check_power_of_two(path: str, value) -> None:
    check(isinstance(value, int) and value > 0 and value & (value - 1) == 0, path, value,
          "must be a power of two, e.g. 64")


@dataclass
class GDNConfig:
    """Gated DeltaNet (letter G): Qwen3-Next / Qwen3.5 linear attention.

    q, k [b, t, num_key_heads, key_head_dim]; v [b, t, num_value_heads, value_head_dim]
    (each key head serves num_value_heads / num_key_heads value heads); recurrent state
    [b, num_value_heads, key_head_dim, value_head_dim] in fp32. HF names in brackets.
    """

    num_key_heads: int = 16  # [linear_num_key_heads]
    num_value_heads: int = 32  # [linear_num_value_heads]
    key_head_dim: int = 128  # [linear_key_head_dim]
    value_head_dim: int = 128  # [linear_value_head_dim]
    conv_kernel: int = 4  # causal depthwise conv over q|k|v [linear_conv_kernel_dim]
    norm_eps: Optional[float] = None  # gated output RMSNorm; None: model.norm_eps
    norm_zero_centered: bool = False  # output norm weight applied as (1 + w) (HF: plain w)
    # training chunk length of the torch op, a power of two (all give the same result); None:
    # 32 for head dims up to 64, else 64 (the faster of the two on CPU, measured)
    chunk_size: Optional[int] = None

    def resolved_chunk_size(self) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return 32 if max(self.key_head_dim, self.value_head_dim) <= 64 else 64

    def validate(self, hidden_size: int, path: str = "model.gdn") -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            check_positive(f"{path}.{name}", getattr(self, name))
        check(self.num_value_heads % self.num_key_heads == 0, f"{path}.num_value_heads", self.num_value_heads,
              f"must be a multiple of num_key_heads={self.num_key_heads}")
        check(self.norm_eps is None or self.norm_eps > 0, f"{path}.norm_eps", self.norm_eps, "must be > 0")
        if self.chunk_size is not None:
            check_power_of_two(f"{path}.chunk_size", self.chunk_size)

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.gdn") -> None:
        check(self.num_key_heads % parallel.tp == 0, f"{path}.num_key_heads", self.num_key_heads,
              f"must be divisible by parallel.tp={parallel.tp} (TP splits whole key-head groups)")


@dataclass
class KDAConfig:
    """Kimi delta attention (letter K): kimi_linear, glm5_next and bailing_hybrid linear layers.

    The gated delta rule with one decay per key channel. q, k, v [b, t, num_heads, head_dim];
    state [b, num_heads, head_dim, head_dim] in fp32. Decay g = -exp(A_log) * softplus(f + dt_bias)
    (kimi_linear), or with ``gate_lower_bound`` the safe gate
    g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) (glm5_next, bailing_hybrid).
    """

    num_heads: int = 32  # [linear_num_heads]
    head_dim: int = 128  # [linear_head_dim]
    conv_kernel: int = 4  # [linear_conv_kernel_dim]
    gate_rank: Optional[int] = None  # forget/output gates hidden -> rank -> heads*head_dim; None: head_dim
    #                                  (kimi_linear, glm5_next); 0: one full-rank projection (bailing_hybrid)
    gate_lower_bound: Optional[float] = None  # safe gate bound, < 0 (glm5_next: -5); None: softplus gate
    norm_eps: Optional[float] = None  # gated output RMSNorm; None: model.norm_eps
    chunk_size: int = 64

    def rank(self) -> int:
        return self.head_dim if self.gate_rank is None else self.gate_rank

    def validate(self, hidden_size: int, path: str = "model.kda") -> None:
        for name in ("num_heads", "head_dim", "conv_kernel"):
            check_positive(f"{path}.{name}", getattr(self, name))
        check(self.gate_rank is None or (isinstance(self.gate_rank, int) and self.gate_rank >= 0),
              f"{path}.gate_rank", self.gate_rank, "must be None (head_dim), 0 (full rank) or a positive integer")
        check(self.gate_lower_bound is None or self.gate_lower_bound < 0, f"{path}.gate_lower_bound",
              self.gate_lower_bound, "must be < 0 (or None for the softplus gate)")
        check(self.norm_eps is None or self.norm_eps > 0, f"{path}.norm_eps", self.norm_eps, "must be > 0")
        check_power_of_two(f"{path}.chunk_size", self.chunk_size)

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.kda") -> None:
        check(self.num_heads % parallel.tp == 0, f"{path}.num_heads", self.num_heads,
              f"must be divisible by parallel.tp={parallel.tp}")


STORE_TIERS = ("disk", "host")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")  # the router's scores (megamoe.layers.mlp.router)


@dataclass
class ExpertStoreConfig:
    """Tiered storage of FROZEN routed experts (LoRA fine-tuning, inference): the weights stay
    in a store and each MoE layer brings in only the experts its tokens were routed to, into a
    bounded cache of hot experts (``megamoe.expert_store``, docs/memory.md).

    budget_mib: MiB of expert weights a rank holds at once over all its MoE layers (the LRU
        cache of hot experts and the experts stacked for one kernel call; with ``map``, the
        experts' file pages mapped in); None: every expert is resident (no tiering).
    tier: ``disk`` reads each expert's slices from the store's safetensors files when it is
        routed to; ``host`` reads this rank's experts once into host memory (pinned on a GPU)
        and copies them to the device when routed to.
    path: the store, a converted megamoe checkpoint directory (``megamoe-convert import-hf``,
        ``megamoe.expert_store.save_converted``); None: the run's ``checkpoint.load`` (fine-tuning) or
        the checkpoint being served.
    prefetch: read the next experts in a background thread while the current ones compute.
    map: the ``disk`` tier on a CPU (Linux): kernels read routed experts in place from the
        store's memory-mapped files, the budget bounding the pages mapped in (no copies);
        false, or where the store cannot be viewed so (another dtype, an ETP slice, a placement
        applied at read time, a rank's experts in two EP pieces, one HF tensor per weight, a
        GPU): positioned reads into the cache's slots.
    """

    budget_mib: Optional[float] = None
    tier: str = "disk"
    path: Optional[str] = None
    prefetch: bool = True
    map: bool = True

    @property
    def enabled(self) -> bool:
        return self.budget_mib is not None

    def validate(self, path: str = "model.moe.expert_store") -> None:
        if self.budget_mib is not None:
            check(isinstance(self.budget_mib, (int, float)) and self.budget_mib > 0, f"{path}.budget_mib",
                  self.budget_mib, "must be > 0 (or null: every expert resident)")
        check_choice(f"{path}.tier", self.tier, STORE_TIERS)
        check_choice(f"{path}.map", self.map, (True, False))


@dataclass
class MoEConfig:
    """Routed experts (letter e): router, SwiGLU experts, optional shared experts.

    Scores are computed in fp32 from ``[tokens, num_experts]`` router logits; each token goes
    to ``top_k`` experts. Placement of MoE layers is the layout string's business only.
    """

    num_experts: int = 8
    top_k: int = 2
    moe_ffn_hidden_size: int = 1024  # per routed expert
    num_shared_experts: int = 0  # shared experts, fused into one SwiGLU of num * size
    shared_expert_ffn_hidden_size: Optional[int] = None  # None: moe_ffn_hidden_size (per shared expert)
    shared_expert_gate: bool = False  # sigmoid(x W_g) scales the shared output (Qwen); off for DeepSeek
    score_function: str = "softmax"  # softmax (over all experts) | sigmoid | sqrtsoftplus (per expert, DeepSeek-V4)
    n_group: int = 1  # expert groups for group-limited routing (DeepSeek-V3)
    topk_group: int = 1  # groups a token may use; 1 group = no limit
    group_score_topk: int = 2  # a group's score: sum of its best this-many scores (1 = max)
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to one
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (after renormalisation)
    expert_bias: bool = False  # aux-loss-free balancing: a bias added to scores for selection only
    expert_bias_update_rate: float = 1e-3  # bias += rate * sign(mean_load - load) per optimizer step
    aux_loss_coeff: float = 0.0  # load-balancing loss over the whole micro-batch (Switch/GShard)
    seq_aux_loss_coeff: float = 0.0  # the same loss per sequence, averaged (DeepSeek-V3)
    z_loss_coeff: float = 0.0  # router z-loss: mean(logsumexp(logits)^2) (ST-MoE)
    capacity_factor: Optional[float] = None  # None: dropless; else tokens per expert per rank cap
    drop_policy: str = "probs"  # with a capacity: keep the highest-weight (probs) or earliest (position)
    dispatcher: str = "alltoall"  # token exchange over the expert grid: alltoall | allgather | static (padded to capacity)
    # alltoall: the shared expert's fc1 runs while the dispatch all-to-alls are in flight, its fc2 while the
    # combine's is (issued async, waited after; backward mirrored)
    shared_expert_overlap: bool = False
    expert_kernel: str = "auto"  # auto | grouped_mm | loop | reference (see megamoe.layers.ops.grouped_gemm)
    swiglu_limit: Optional[float] = None  # routed and shared experts: clamp as MLPConfig.swiglu_limit (GLM-5)
    swiglu_alpha: Optional[float] = None  # routed and shared experts: SwiGLU-OAI as MLPConfig.swiglu_alpha
    # expert placement {layer: order}: slot s (EP rank s // (E/ep)) holds the HF checkpoint's
    # expert order[s]; applied by the converter (megamoe.core.placement). None: slot s holds expert s
    placement: Optional[Dict[str, List[int]]] = None
    # redundant hot experts (DeepSeek's EPLB): N extra expert slots, N/ep on each EP rank, slot i
    # holding a copy of HF expert replicas[layer][i] (default: spread, default_replicas); the tokens
    # routed to an expert are split among its copies (megamoe.layers.mlp.replicas)
    redundant_experts: int = 0
    replicas: Optional[Dict[str, List[int]]] = None
    # where frozen experts live (LoRA fine-tuning, inference): see ExpertStoreConfig
    expert_store: ExpertStoreConfig = field(default_factory=ExpertStoreConfig)

    def shared_ffn(self) -> int:
        """Width of the fused shared-expert SwiGLU (0 without shared experts)."""
        per = self.shared_expert_ffn_hidden_size or self.moe_ffn_hidden_size
        return per * self.num_shared_experts

    def replica_experts(self, layer: int) -> Optional[List[int]]:
        """Router indices of the experts that ``layer``'s N extra slots copy (None: no replicas)."""
        if not self.redundant_experts:
            return None
        ids = layer_entry(self.replicas, layer) or default_replicas(self.num_experts, self.redundant_experts)
        return router_index(ids, layer_entry(self.placement, layer))

    def validate(self, hidden_size: int, path: str = "model.moe") -> None:
        for name in ("num_experts", "top_k", "moe_ffn_hidden_size", "n_group", "topk_group",
                     "group_score_topk"):
            check_positive(f"{path}.{name}", getattr(self, name))
        check(self.top_k <= self.num_experts, f"{path}.top_k", self.top_k,
              f"must be <= num_experts={self.num_experts}")
        check(isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0,
              f"{path}.num_shared_experts", self.num_shared_experts, "must be an integer >= 0")
        if self.shared_expert_ffn_hidden_size is not None:
            check_positive(f"{path}.shared_expert_ffn_hidden_size", self.shared_expert_ffn_hidden_size)
        check(not self.shared_expert_gate or self.num_shared_experts > 0, f"{path}.shared_expert_gate",
              self.shared_expert_gate, "needs num_shared_experts > 0")
        check_choice(f"{path}.score_function", self.score_function, SCORE_FUNCTIONS)
        check(self.num_experts % self.n_group == 0, f"{path}.n_group", self.n_group,
              f"must divide num_experts={self.num_experts}")
        check(self.topk_group <= self.n_group, f"{path}.topk_group", self.topk_group,
              f"must be <= n_group={self.n_group}")
        per_group = self.num_experts // self.n_group
        check(self.n_group == 1 or self.group_score_topk <= per_group, f"{path}.group_score_topk",
              self.group_score_topk, f"must be <= experts per group={per_group}")
        check(self.top_k <= self.topk_group * per_group, f"{path}.top_k", self.top_k,
              f"must be <= topk_group*experts per group={self.topk_group * per_group}")
        check(self.routed_scaling_factor > 0, f"{path}.routed_scaling_factor", self.routed_scaling_factor,
              "must be > 0")
        check(self.expert_bias_update_rate >= 0, f"{path}.expert_bias_update_rate",
              self.expert_bias_update_rate, "must be >= 0")
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff"):
            check(getattr(self, name) >= 0, f"{path}.{name}", getattr(self, name), "must be >= 0")
        if self.capacity_factor is not None:
            check(self.capacity_factor > 0, f"{path}.capacity_factor", self.capacity_factor,
                  "must be > 0 (or null for dropless)")
        check_choice(f"{path}.drop_policy", self.drop_policy, ("probs", "position"))
        check_choice(f"{path}.dispatcher", self.dispatcher, ("alltoall", "allgather", "static"))
        if self.dispatcher == "static":
            check(self.capacity_factor is not None, f"{path}.capacity_factor", self.capacity_factor,
                  "must be set with dispatcher=static (every expert gets that many rows per rank)")
        check_choice(f"{path}.expert_kernel", self.expert_kernel, ("auto", "grouped_mm", "loop", "reference"))
        check_swiglu(path, self.swiglu_limit, self.swiglu_alpha)
        self.expert_store.validate(f"{path}.expert_store")
        n = self.redundant_experts
        check(isinstance(n, int) and n >= 0, f"{path}.redundant_experts", n, "must be an integer >= 0")
        check(not self.replicas or n > 0, f"{path}.replicas", "{...}", "needs redundant_experts > 0")
        check(not n or self.expert_store.budget_mib is None, f"{path}.redundant_experts", n,
              "replicas of experts kept in a store (model.moe.expert_store.budget_mib) are not supported")

    def validate_parallel(self, parallel: "ParallelConfig", path: str = "model.moe") -> None:
        check(self.num_experts % parallel.ep == 0, f"{path}.num_experts", self.num_experts,
              f"must be divisible by parallel.ep={parallel.ep}")
        check(self.moe_ffn_hidden_size % parallel.etp == 0, f"{path}.moe_ffn_hidden_size",
              self.moe_ffn_hidden_size, f"must be divisible by parallel.etp={parallel.etp}")
        check(self.shared_ffn() % parallel.tp == 0, f"{path}.shared_expert_ffn_hidden_size",
              self.shared_ffn(), f"(times num_shared_experts) must be divisible by parallel.tp={parallel.tp}")
        check(self.redundant_experts % parallel.ep == 0, f"{path}.redundant_experts", self.redundant_experts,
              f"must be divisible by parallel.ep={parallel.ep} (each EP rank holds the same number of replicas)")


@dataclass
class ScaledResidualConfig:
    """MiniMax-01 residual (``model.scaled_residual``; replaces the pre-norm residual of every layer).

    The residual starts after the norm and both terms are scaled (HF MiniMax ``*_alpha_factor`` /
    ``*_beta_factor``)::

        n = norm(x);  x = alpha * n + beta * f(n)        for f = mixer, then MLP

    ``mixer_alpha`` / ``mixer_beta`` by mixer letter (a letter not listed: 1.0).
    """

    mixer_alpha: Dict[str, float] = field(default_factory=dict)
    mixer_beta: Dict[str, float] = field(default_factory=dict)
    mlp_alpha: float = 1.0
    mlp_beta: float = 1.0

    def factors(self, letter: str) -> tuple:
        return self.mixer_alpha.get(letter, 1.0), self.mixer_beta.get(letter, 1.0)

    def validate(self, path: str = "model.scaled_residual") -> None:
        for name in ("mixer_alpha", "mixer_beta"):
            unknown = [k for k in getattr(self, name) if k not in MIXERS]
            check(not unknown, f"{path}.{name}", unknown, f"keys must be mixer letters ({', '.join(MIXERS)})")


@dataclass
class HyperConnectionConfig:
    """Manifold-constrained hyper-connections (``model.hyper_connections``; GLM-5's mHC).

    The residual stream is ``streams`` copies [b, s, streams, h]. Around the mixer and around the
    MLP, per token, weights are computed from all streams (RMS-normalised, one linear map):
    ``pre`` (streams -> block input), ``post`` (block output -> streams) and ``comb`` (streams x
    streams, made doubly stochastic by ``sinkhorn_iters`` Sinkhorn steps)::

        y = block(sum_i pre_i x_i);   x'_j = post_j * y + sum_i comb_ij x_i

    The embedding enters every stream. The final norm reads their mean (``head: mean``, GLM-5) or
    their sum weighted per token like ``pre`` (``head: learned``, DeepSeek-V4's ``hc_head``:
    ``sigmoid(rms(x) W_h^T * s_h + b_h) + eps``, a [streams, streams*h] map). HF names in brackets.
    """

    streams: int = 4  # [hc_mult]
    sinkhorn_iters: int = 20  # [hc_sinkhorn_iters]
    eps: float = 1e-6  # [hc_eps] floor added to pre and comb, and in the Sinkhorn divisions
    norm_eps: Optional[float] = None  # the unweighted RMS norm over all streams; None: model.norm_eps
    head: str = "mean"  # how the last layer's streams reach the final norm: mean | learned [hc_head]

    def validate(self, path: str = "model.hyper_connections") -> None:
        check_positive(f"{path}.streams", self.streams)
        check_choice(f"{path}.head", self.head, ("mean", "learned"))
        check_positive(f"{path}.sinkhorn_iters", self.sinkhorn_iters)
        check(self.eps >= 0, f"{path}.eps", self.eps, "must be >= 0")
        check(self.norm_eps is None or self.norm_eps > 0, f"{path}.norm_eps", self.norm_eps, "must be > 0")


@dataclass
class Fp8BaseConfig:
    """Frozen FP8 base weights (``import-hf --keep-fp8``, ``megamoe.model.fp8_base``): the named linear
    and expert weights stay e4m3 with their float32 block scales in memory and in checkpoints,
    dequantised per GEMM; they never train (adapters and every other weight do)."""

    block: list = field(default_factory=lambda: [128, 128])  # the release's weight_block_size (rows, cols)
    tensors: list = field(default_factory=list)  # megamoe parameter names held in FP8

    def validate(self, path: str) -> None:
        check(len(self.block) == 2 and all(isinstance(b, int) and b > 0 for b in self.block), f"{path}.block",
              self.block, "must be two positive integers")
        check(all(isinstance(t, str) for t in self.tensors), f"{path}.tensors", self.tensors,
              "must be parameter names")


@dataclass
class MTPConfig:
    """Multi-token prediction (``model.mtp``), as DeepSeek-V3 defines its MTP modules.

    ``num_layers`` depths follow the last layer (HF ``num_nextn_predict_layers`` or
    ``mtp_num_hidden_layers``). Depth k (0-based) reads h^k at position i (h^0: the main model's
    final-normed hidden state) and the embedding of token i+k+1, and predicts token i+k+2::

        h^{k+1}_i = norm_k(layer_k(eh_proj_k([enorm_k(E(t_{i+k+1})), hnorm_k(h^k_i)])))
        logits^k_i = h^{k+1}_i W_out^T

    with the model's own embedding E and output layer W_out (shared, not copies). ``layout``:
    each depth's decoder layer, one mixer+MLP letter pair per depth, or one pair for all depths
    (e.g. ``Me``: MLA and routed experts, as DeepSeek-V3's MTP layer).
    """

    num_layers: int = 1
    layout: str = "Ae"

    def kinds(self) -> tuple[LayerKind, ...]:
        """The decoder layer kind of every depth."""
        layers = parse_layout(self.layout, "model.mtp.layout").layers
        return layers * self.num_layers if len(layers) == 1 else layers

    def validate(self, path: str = "model.mtp") -> None:
        check_positive(f"{path}.num_layers", self.num_layers)
        layout = parse_layout(self.layout, f"{path}.layout")
        check(not layout.cuts, f"{path}.layout", self.layout, "has no pipeline cuts (every depth sits on the last stage)")
        check(layout.num_layers in (1, self.num_layers), f"{path}.layout", self.layout,
              f"gives one layer for every depth or {self.num_layers} (num_layers), not {layout.num_layers}")


@dataclass
class ModelConfig:
    """A causal language model (plus, later, its vision encoder) described by a layout string.

    The residual of every layer is pre-norm (``x + f(norm(x))``) unless one of
    ``scaled_residual`` (MiniMax) or ``hyper_connections`` (GLM-5, DeepSeek-V4) is set."""

    vocab_size: int = 32000
    hidden_size: int = 512
    layout: str = "AdAd"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    moe: Optional[MoEConfig] = None  # routed experts (layout letter e)
    lightning: Optional[LightningConfig] = None  # letter L
    mla: Optional[MLAConfig] = None  # letters M, D, R, I
    gdn: Optional[GDNConfig] = None  # letter G
    kda: Optional[KDAConfig] = None  # letter K
    compressed: Optional[CompressedAttentionConfig] = None  # letters W, C, H (DeepSeek-V4)
    scaled_residual: Optional[ScaledResidualConfig] = None  # MiniMax residual (see the class)
    hyper_connections: Optional[HyperConnectionConfig] = None  # GLM-5 / DeepSeek-V4 residual streams (see the class)
    norm_eps: float = 1e-6
    norm_zero_centered: bool = False  # RMSNorm weight applied as (1 + w), stored zero-initialised
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    init_std: float = 0.02
    params_dtype: str = "float32"
    backend: str = "auto"  # role provider (megamoe.layers.backends): auto | local (pure-torch reference) | cpu | cuda | te
    fusion: Optional[str] = None  # auto | on | off: compiled elementwise kernels (megamoe.layers.ops.fusion); None: MEGAMOE_FUSION
    vision: Optional[VisionConfig] = None  # image encoder + projector (megamoe.model.multimodal)
    fp8_base: Optional[Fp8BaseConfig] = None  # weights kept in FP8 (import-hf --keep-fp8; megamoe.model.fp8_base)
    mtp: Optional[MTPConfig] = None  # multi-token-prediction depths after the last layer (megamoe.model.mtp)

    def parsed_layout(self) -> Layout:
        return parse_layout(self.layout, "model.layout")

    def validate(self, path: str = "model") -> Layout:
        check_positive(f"{path}.vocab_size", self.vocab_size)
        check_positive(f"{path}.hidden_size", self.hidden_size)
        check_positive(f"{path}.max_seq_len", self.max_seq_len)
        check(self.norm_eps > 0, f"{path}.norm_eps", self.norm_eps, "must be > 0")
        check(self.init_std > 0, f"{path}.init_std", self.init_std, "must be > 0")
        check_choice(f"{path}.params_dtype", self.params_dtype, tuple(DTYPES))
        # the registry (megamoe.layers.backends) knows the names; building the model checks them
        check(isinstance(self.backend, str) and self.backend.isidentifier(), f"{path}.backend", self.backend,
              "must be a backend name")
        if self.fusion is not None:
            # YAML 1.1 reads a bare on/off as a boolean, which OmegaConf then stores as 'True'/'False'
            self.fusion = {"True": "on", "False": "off"}.get(str(self.fusion), self.fusion)
            check_choice(f"{path}.fusion", self.fusion, FUSION_MODES)
        layout = parse_layout(self.layout, f"{path}.layout")
        check_selection_sources(layout, [list(range(layout.num_layers))], f"{path}.layout")
        if self.mtp is not None:
            self.mtp.validate(f"{path}.mtp")
        self._validate_sections(layout, path)
        self._validate_residual(path)
        if self.moe is not None and self.moe.placement:
            moe_layers = [i for i, k in enumerate(layout.layers) if k.mlp in MOE_LETTERS]
            check_placement(self.moe.placement, self.moe.num_experts, moe_layers, self.moe.n_group,
                            f"{path}.moe.placement")
        if self.moe is not None and self.moe.replicas:
            moe_layers = [i for i, k in enumerate(layout.layers) if k.mlp in MOE_LETTERS]
            check_replicas(self.moe.replicas, self.moe.redundant_experts, self.moe.num_experts, moe_layers,
                           f"{path}.moe.replicas")
        if self.fp8_base is not None:
            self.fp8_base.validate(f"{path}.fp8_base")
            check(self.moe is None or not self.moe.redundant_experts, f"{path}.moe.redundant_experts",
                  self.moe and self.moe.redundant_experts, "replicas of a frozen FP8 base (model.fp8_base) are not "
                  "supported")
        if self.vision is not None:
            self.vision.validate(self.hidden_size, f"{path}.vision")
            check(self.vision.image_token_id < self.vocab_size, f"{path}.vision.image_token_id",
                  self.vision.image_token_id, f"must be < vocab_size={self.vocab_size}")
        return layout

    def used_sections(self, layout: Layout, path: str = "model") -> dict:
        """Config sections the layout's letters need, by name; a missing one is an error.

        Every section implements ``validate(hidden_size, path)`` and
        ``validate_parallel(parallel, path)``. The MTP depths' layers count as the layout's.
        """
        used = {letter: f"{path}.layout" for letter in layout.counts()}
        for kind in self.mtp.kinds() if self.mtp is not None else ():  # the MTP depths' layers too
            used.setdefault(kind.mixer, f"{path}.mtp.layout")
            used.setdefault(kind.mlp, f"{path}.mtp.layout")
        sections = {}
        for letter, (what, section) in [*MIXERS.items(), *MLPS.items()]:
            if letter not in used or section is None or section in sections:
                continue
            sub = getattr(self, section, None)
            if sub is None:
                raise ConfigError(f"{path}.{section} is not set but {used[letter]} uses '{letter}' ({what})")
            sections[section] = sub
        return sections

    def _validate_sections(self, layout: Layout, path: str) -> None:
        for name, sub in self.used_sections(layout, path).items():
            sub.validate(self.hidden_size, f"{path}.{name}")

    def _validate_residual(self, path: str) -> None:
        check(self.scaled_residual is None or self.hyper_connections is None, f"{path}.hyper_connections",
              "set", "cannot be combined with model.scaled_residual (choose one residual style)")
        for name in ("scaled_residual", "hyper_connections"):
            if getattr(self, name) is not None:
                getattr(self, name).validate(f"{path}.{name}")


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
    # GPUs per node (None: the launcher's LOCAL_WORLD_SIZE, else one node): TP and ETP must stay
    # inside a node, EP should (megamoe.parallel.topology)
    gpus_per_node: Optional[int] = None

    def validate(self, world_size: Optional[int] = None, path: str = "parallel") -> None:
        for f in fields(self):
            if f.type is int:
                check_positive(f"{path}.{f.name}", getattr(self, f.name))
        if self.gpus_per_node is not None:
            check_positive(f"{path}.gpus_per_node", self.gpus_per_node)
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


def check_pipeline_support(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Pipeline layouts the trainer cannot run yet (it and the planner both call this)."""
    if parallel.vpp > 1 and parallel.pp == 1:
        raise ConfigError("parallel.vpp>1 needs parallel.pp>1 (virtual stages interleave pipeline ranks)")
    attention = getattr(model, "attention", None)
    if (parallel.pp * parallel.vpp > 1 and model.vision is not None and attention is not None
            and attention.mrope_section is not None):
        raise ConfigError("parallel.pp>1 with model.attention.mrope_section: later pipeline stages would need "
                          "the multimodal positions of the first; use pp=1 for M-RoPE models")


def validate_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> Layout:
    """Checks that need both the model and the parallel layout."""
    layout = model.validate()
    parallel.validate()
    for name, sub in model.used_sections(layout).items():
        sub.validate_parallel(parallel, f"model.{name}")
    if model.vision is not None:
        model.vision.validate_parallel(parallel, "model.vision")
    check_selection_sources(layout, layout.stages(parallel.pp * parallel.vpp), "model.layout")
    return layout


def check_selection_sources(layout: Layout, stages: list, path: str) -> None:
    """An ``R`` layer reuses the selection of an earlier indexer layer (D, I) of its own pipeline
    stage (selections do not travel between stages)."""
    for stage in stages:
        seen = False
        for i in stage:
            letter = layout.layers[i].mixer
            seen = seen or letter in "DI"
            check(letter != "R" or seen, path, layout.text,
                  f"layer {i} ('R') needs an earlier D or I layer in its pipeline stage to reuse the selection of")
