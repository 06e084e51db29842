"""Model assembly: where the core (config, layout, specs, groups) meets megamoe.layers.

``LanguageModel`` builds the stack a layout string describes. Under pipeline parallelism a
stage builds only its layers (named by their global index, so checkpoints do not depend on
the layout), the first stage the embedding, the last the final norm and output layer.

Context parallelism (CP, ``parallel.cp``) is applied here and only here: every stage takes
full-sequence inputs (``input_ids``, ``positions``, ``labels`` [b, S], ``documents``), builds
``ContextShard(groups.cp, S)`` and cuts them to this rank's two chunks (multimodal: the image
tokens are merged into the local chunks, see ``megamoe.model.multimodal``); hidden states between
pipeline stages and the logits cover the local tokens only. The trainer and the data loader
hand every CP rank of a data-parallel rank the same full samples.

Shapes: input_ids [b, S]; hidden states [b, s, h] with s = S/cp the local tokens
(``[b, s/tp, h]`` under sequence parallelism); logits [b, s, V].
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import megamoe.layers  # noqa: F401  (registers the layout letters)
from megamoe.layers.ops.fusion import Fusion
from megamoe.core.config import ModelConfig
from megamoe.core.dtypes import DTYPES
from megamoe.core.errors import ConfigError
from megamoe.model.fp8_base import keep_fp8
from megamoe.layers.backends import get_backend
from megamoe.layers.hyper_connection import HyperConnection, HyperHead, expand_streams, merge_streams
from megamoe.core.layout import MIXERS, MLPS, LayerKind
from megamoe.model.mtp import MTPTargets, add_mtp_loss, build_depths
from megamoe.parallel import comm
from megamoe.parallel.context import ContextShard, split_for_cp
from megamoe.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.linear import VocabParallelEmbedding
from megamoe.parallel.sharding import Shard, mark_init, normal_init, set_sharding
from megamoe.layers.spec import BuildContext, ForwardInfo, build_module, mixer_spec, mlp_spec


RECOMPUTE_CHOICES = ("layer", "mixer", "mlp", "core")  # core: the linear mixers' chunk ops


def _maybe_recompute(enabled: bool, fn, *args):
    """Run fn, keeping only its inputs for backward and recomputing the rest when enabled."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)).

    ``recompute`` (set by ``LanguageModel.set_recompute``): parts whose activations are
    recomputed in backward instead of kept: "layer", "mixer" and/or "mlp".
    """

    def __init__(self, kind: LayerKind, cfg: ModelConfig, ctx: BuildContext, layer_number: int):
        super().__init__()
        self.kind, self.layer_number = kind, layer_number
        self.recompute: frozenset = frozenset()
        h, b = ctx.hidden_size, ctx.backend
        self.input_norm = b.norm(ctx, h, sequence_parallel=True)
        self.mixer = build_module(mixer_spec(kind.mixer), getattr(cfg, MIXERS[kind.mixer][1]), ctx,
                                  layer_number)
        section = MLPS[kind.mlp][1]
        if section is None:
            self.pre_mlp_norm = self.mlp = None
        else:
            self.pre_mlp_norm = b.norm(ctx, h, sequence_parallel=True)
            self.mlp = build_module(mlp_spec(kind.mlp), getattr(cfg, section), ctx, layer_number)

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        with comm.tag_scope(f"layer{self.layer_number}"):  # labels this layer's collectives
            return _maybe_recompute("layer" in self.recompute, self._forward, x, info)

    def _forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        x = x + _maybe_recompute("mixer" in self.recompute, self._mix, x, info)
        if self.mlp is not None:
            x = x + _maybe_recompute("mlp" in self.recompute, self._mlp, x, info)
        return x

    def _mix(self, x, info):
        return self.mixer(self.input_norm(x), info)

    def _mlp(self, x, info):
        return self.mlp(self.pre_mlp_norm(x), info)

    # The residual stream between layers; other residual styles carry more than [b, s, h].
    @staticmethod
    def enter_stream(hidden: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """Embedding output [b, s, h] -> the residual stream the layers read."""
        return hidden

    @staticmethod
    def leave_stream(stream: torch.Tensor) -> torch.Tensor:
        """The last layer's residual stream -> [b, s, h] for the final norm."""
        return stream

    @staticmethod
    def stream_head(cfg: ModelConfig, ctx: BuildContext) -> nn.Module | None:
        """A module with weights that replaces ``leave_stream`` on the last stage (None: none)."""
        return None


class ScaledResidualLayer(DecoderLayer):
    """MiniMax-01 residual (``model.scaled_residual``): the residual starts after the norm and
    both terms are scaled: n = norm(x); x = alpha * n + beta * f(n), for the mixer then the MLP."""

    def __init__(self, kind: LayerKind, cfg: ModelConfig, ctx: BuildContext, layer_number: int):
        super().__init__(kind, cfg, ctx, layer_number)
        scaled = cfg.scaled_residual
        self.mixer_alpha, self.mixer_beta = scaled.factors(kind.mixer)
        self.mlp_alpha, self.mlp_beta = scaled.mlp_alpha, scaled.mlp_beta

    def _forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        n = self.input_norm(x)
        x = self.mixer_alpha * n + self.mixer_beta * _maybe_recompute("mixer" in self.recompute, self.mixer, n, info)
        if self.mlp is not None:
            n = self.pre_mlp_norm(x)
            x = self.mlp_alpha * n + self.mlp_beta * _maybe_recompute("mlp" in self.recompute, self.mlp, n, info)
        return x


class HyperConnectionLayer(DecoderLayer):
    """GLM-5 hyper-connections (``model.hyper_connections``, ``megamoe.layers.hyper_connection``):
    the residual stream is [b, s, n, h]; the mixer and the MLP each read a weighted sum of the
    streams (pre-norm inside) and write back into all of them."""

    def __init__(self, kind: LayerKind, cfg: ModelConfig, ctx: BuildContext, layer_number: int):
        super().__init__(kind, cfg, ctx, layer_number)
        self.mixer_hc = HyperConnection(cfg.hyper_connections, ctx)
        self.mlp_hc = None if self.mlp is None else HyperConnection(cfg.hyper_connections, ctx)

    def _forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        x = self.mixer_hc(x, lambda y: _maybe_recompute("mixer" in self.recompute, self._mix, y, info))
        if self.mlp is not None:
            x = self.mlp_hc(x, lambda y: _maybe_recompute("mlp" in self.recompute, self._mlp, y, info))
        return x

    @staticmethod
    def enter_stream(hidden: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        return expand_streams(hidden, cfg.hyper_connections.streams)

    @staticmethod
    def leave_stream(stream: torch.Tensor) -> torch.Tensor:
        return merge_streams(stream)

    @staticmethod
    def stream_head(cfg: ModelConfig, ctx: BuildContext) -> nn.Module | None:
        """DeepSeek-V4's learned collapse of the streams (``hyper_connections.head: learned``)."""
        return HyperHead(cfg.hyper_connections, ctx) if cfg.hyper_connections.head == "learned" else None


def layer_class(cfg: ModelConfig) -> type[DecoderLayer]:
    """The layer block of the config's residual style (validated: at most one section is set)."""
    if cfg.hyper_connections is not None:
        return HyperConnectionLayer
    if cfg.scaled_residual is not None:
        return ScaledResidualLayer
    return DecoderLayer


class OutputLayer(nn.Module):
    """Vocab-parallel output projection: [b, s(/tp), h] -> [b, s, V_pad/tp] logits.

    ``weight`` is None when tied to the embedding (passed to forward instead).
    """

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, padded_vocab: int, tied: bool):
        super().__init__()
        self.group, self.sp = ctx.groups.tp, ctx.sp
        if tied:
            self.register_parameter("weight", None)
        else:
            w = torch.empty(padded_vocab // ctx.groups.tp_size, ctx.hidden_size, dtype=ctx.dtype,
                            device=ctx.device)
            self.weight = nn.Parameter(w)
            set_sharding(self.weight, Shard(0, "tp", unpadded=cfg.vocab_size))
            mark_init(self.weight, normal_init(ctx.init_std))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.sp:
            x = comm.gather_reduce_scatter(x, 1, self.group)
        else:
            x = comm.copy_to(x, self.group)
        return torch.nn.functional.linear(x, self.weight if weight is None else weight)


def build_context(cfg: ModelConfig, groups: ParallelGroups | None = None, *,
                  sequence_parallel: bool = False, device=None, fp8: str | None = None) -> BuildContext:
    """``fp8``: the FP8 recipe the backend's GEMMs run (train.fp8; None: none)."""
    layout = cfg.validate()
    backend = get_backend(cfg.backend, Fusion.from_config(cfg.fusion), fp8=fp8)  # the model's own instance
    return BuildContext(
        hidden_size=cfg.hidden_size, groups=groups or ParallelGroups(), backend=backend,
        sequence_parallel=sequence_parallel, norm_eps=cfg.norm_eps, norm_zero_centered=cfg.norm_zero_centered,
        init_std=cfg.init_std, num_layers=layout.num_layers, dtype=DTYPES[cfg.params_dtype], device=device,
        vocab_size=cfg.vocab_size)


class LanguageModel(nn.Module):
    """A decoder-only LM from a layout string.

    ``layer_ids``: global layer indices this pipeline stage holds (default: all);
    ``pre_process``/``post_process``: whether it holds the embedding / norm+output (and the
    multi-token-prediction depths ``mtp``, which also read the embedding: ``megamoe.model.mtp``).
    """

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups | None = None, *,
                 sequence_parallel: bool = False, layer_ids: Sequence[int] | None = None,
                 pre_process: bool = True, post_process: bool = True, device=None, fp8: str | None = None):
        super().__init__()
        self.config = cfg
        self.layout = cfg.validate()
        self.ctx = ctx = build_context(cfg, groups, sequence_parallel=sequence_parallel, device=device, fp8=fp8)
        self.groups = ctx.groups
        self.pre_process, self.post_process = pre_process, post_process
        ids = range(self.layout.num_layers) if layer_ids is None else layer_ids
        self.block = layer_class(cfg)
        self.layers = nn.ModuleDict({str(i): self.block(self.layout.layers[i], cfg, ctx, i) for i in ids})
        self.cp_size = ctx.groups.size("cp")
        self.embedding = None
        if pre_process or (post_process and (cfg.tie_embeddings or cfg.mtp is not None)):
            self.embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.groups.tp,
                                                    sequence_parallel=ctx.sp, init_std=cfg.init_std,
                                                    dtype=ctx.dtype, device=device)
        self.stream_head = self.block.stream_head(cfg, ctx) if post_process else None
        if post_process:
            self.final_norm = ctx.backend.norm(ctx, cfg.hidden_size, sequence_parallel=True)
            padded = self.embedding.padded_vocab if self.embedding is not None else \
                -(-cfg.vocab_size // ctx.groups.tp_size) * ctx.groups.tp_size
            self.output_layer = OutputLayer(cfg, ctx, padded, tied=cfg.tie_embeddings)
        self.mtp = build_depths(cfg, ctx, self.block) if post_process and cfg.mtp is not None else None
        self.mtp_loss_sums = torch.zeros(len(self.mtp or ()), dtype=torch.float64)  # see megamoe.model.mtp.add_mtp_loss
        if cfg.fp8_base is not None:
            keep_fp8(self, cfg.fp8_base)  # the released FP8 weights stay e4m3 (megamoe.model.fp8_base)

    def set_recompute(self, parts) -> None:
        """Selective activation recomputation for every layer: any of RECOMPUTE_CHOICES."""
        parts = frozenset(parts)
        unknown = parts - set(RECOMPUTE_CHOICES)
        if unknown:
            raise ConfigError(f"train.recompute={sorted(parts)} is invalid: allowed: {', '.join(RECOMPUTE_CHOICES)}")
        for layer in [*self.layers.values(), *(d.layer for d in self.mtp or ())]:
            layer.recompute = parts
            mixer = getattr(layer, "mixer", None)
            if hasattr(mixer, "recompute_core"):
                mixer.recompute_core = "core" in parts

    # ---- pieces -------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] -> [b, s, h] (``[b, s/tp, h]`` under SP)."""
        return self.embedding(input_ids)

    def run_layers(self, hidden: torch.Tensor, info: ForwardInfo, after: dict | None = None) -> torch.Tensor:
        """This stage's layers. The first stage takes [b, s(/tp), h] into the residual stream
        (``[b, s(/tp), n, h]`` with hyper-connections), the last one gives [b, s(/tp), h] back.
        ``after``: {global layer index: [b, s(/tp), h]} added to the stream after that layer
        (Qwen3-VL's deepstack image features; plain residual streams only)."""
        if self.pre_process:
            hidden = self.block.enter_stream(hidden, self.config)
        for name, layer in self.layers.items():
            hidden = layer(hidden, info)
            if after and int(name) in after:
                hidden = hidden + after[int(name)]
        return self.leave_stream(hidden) if self.post_process else hidden

    def leave_stream(self, stream: torch.Tensor) -> torch.Tensor:
        """The last layer's residual stream -> [b, s(/tp), h] for the final norm."""
        return self.block.leave_stream(stream) if self.stream_head is None else self.stream_head(stream)

    def head(self, hidden: torch.Tensor, info: ForwardInfo | None = None,
             mtp: MTPTargets | None = None) -> torch.Tensor:
        """[b, s(/tp), h] -> vocab-parallel logits [b, s, V_pad/tp]; with ``mtp`` (training) the
        MTP depths' loss is attached to their gradient (``megamoe.model.mtp.add_mtp_loss``)."""
        normed = self.final_norm(hidden)
        logits = self.output(normed)
        if mtp is not None and self.mtp is not None:
            logits = add_mtp_loss(self, logits, normed, mtp, info)
        return logits

    def output(self, normed: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [b, s(/tp), h] -> vocab-parallel logits [b, s, V_pad/tp]."""
        tied = self.embedding.weight if self.config.tie_embeddings else None
        return self.output_layer(normed, tied)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[b, s, V_pad/tp] -> [b, s, V] on every TP rank."""
        full = comm.gather_from(local_logits, -1, self.groups.tp)
        return full[..., : self.config.vocab_size]

    def sequence_shard(self, seq_len: int, cache=None) -> ContextShard | None:
        """This rank's share of a sequence of ``seq_len`` tokens under CP; None without CP. With a
        decode cache CP applies to its first forward only (the prefill: every mixer leaves the
        whole sequence's state in the cache, or, in a split cache, softmax/MLA keep their rank's
        share); the forwards after it run the same on every CP rank (a split cache merges the
        ranks' attention inside)."""
        if self.cp_size == 1 or (cache is not None and cache.seen > 0):
            return None
        if cache is not None and cache.pad is not None:
            raise ConfigError(f"parallel.cp={self.cp_size}: a prefill under context parallelism needs prompts of "
                              f"equal length (this batch is left-padded)")
        return ContextShard(self.groups.cp, seq_len)

    def loss_sum(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of the token losses of this rank's tokens: labels [b, S] (full sequence, cut here to
        the local CP chunks) against vocab-parallel logits [b, s, V_pad/tp]."""
        labels = split_for_cp(self.sequence_shard(labels.size(1)), labels)
        return vocab_parallel_cross_entropy(local_logits, labels, self.groups.tp, self.config.vocab_size).sum()

    def loss(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean causal-LM loss over tokens whose label is not -100, the whole sequence's value on
        every CP rank. Backward gives each CP rank its own tokens' share (the trainer sums
        gradients over ``dp_cp``, so the sum is the single-process gradient)."""
        count = (labels != IGNORE_INDEX).sum().clamp(min=1)  # full labels: the global count
        return comm.reduce_from(self.loss_sum(local_logits, labels), self.groups.cp) / count

    def full_length(self, input_ids: torch.Tensor | None, hidden: torch.Tensor | None, cache=None) -> int:
        """S, the full sequence a stage input stands for (hidden states are cut over SP, and over
        CP unless they are a decode step after a CP prefill)."""
        if input_ids is not None:
            return input_ids.size(1)
        cp = self.cp_size if cache is None or cache.seen == 0 else 1
        return hidden.size(1) * (self.groups.tp_size if self.ctx.sp else 1) * cp

    def default_positions(self, input_ids: torch.Tensor | None, hidden: torch.Tensor | None,
                          cache=None) -> torch.Tensor:
        """0..S-1 for every sample, S being the full sequence (also on SP and CP shards); after the
        tokens a decode cache has already seen."""
        ref = input_ids if input_ids is not None else hidden
        b, s, device = ref.size(0), self.full_length(input_ids, hidden, cache), ref.device
        if cache is not None:  # after what it has seen; a left-padded row counts from its first token
            return cache.positions(s, device)
        return torch.arange(s, device=device).unsqueeze(0).expand(b, -1)

    # ---- forward ------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, *, labels: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """Logits [b, s, V] (labels None), the mean loss (labels given) or, on a stage without the
        output layer, hidden states. ``labels[b, t]`` is the target of position t (already
        shifted; see ``shift_labels``)."""
        out = self.forward_stage(input_ids if self.pre_process else hidden, positions=positions, cache=cache)
        if not self.post_process:
            return out
        if labels is None:
            return self.gather_logits(out)
        return self.loss(out, labels)

    def forward_stage(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                      documents: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                      mtp: MTPTargets | None = None) -> torch.Tensor:
        """One pipeline stage: token ids [b, S] (first stage) or hidden states in; hidden states
        or, on the last stage, vocab-parallel logits [b, s, V_pad/tp] out. ``positions`` [b, S]
        (or [3, b, S]), ``documents`` [b, S] and ``token_ids`` [b, S] (later stages: the input
        ids, which hash-routed MoE layers read) cover the full sequence on every stage; ``mtp``:
        the last stage's multi-token-prediction targets in training (``megamoe.model.mtp``)."""
        ids, hidden = (x, None) if self.pre_process else (None, x)
        token_ids = ids if ids is not None else token_ids
        shard = self.sequence_shard(self.full_length(ids, hidden, cache), cache)
        if positions is None:
            positions = self.default_positions(ids, hidden, cache)
        if self.pre_process:
            hidden = self.embed(split_for_cp(shard, ids))
        info = ForwardInfo(positions=split_for_cp(shard, positions, dim=-1), cache=cache, cp=shard, documents=documents,
                           token_ids=split_for_cp(shard, token_ids))
        # te: one FP8 autocast per stage forward, the last stage's MTP depths inside it too
        with self.ctx.backend.stage_context(self.groups):
            hidden = self.run_layers(hidden, info)
            if cache is not None:  # every pipeline stage keeps its own cache
                cache.advance(positions.size(-1))
            return self.head(hidden, info, mtp) if self.post_process else hidden


def shift_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets: labels[:, t] = input_ids[:, t+1], the last position ignored."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels
