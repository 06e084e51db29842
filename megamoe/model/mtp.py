"""Multi-token prediction (``model.mtp``): DeepSeek-V3's MTP modules as layers of the last stage.

Depth k (0-based) of ``model.mtp.num_layers`` reads h^k (h^0: the main model's final-normed hidden
state, the output layer's input) and the embedding of the token k+1 ahead, and predicts the
token k+2 ahead through the model's own (shared) output layer::

    x       = eh_proj_k([enorm_k(E(t_{i+k+1})), hnorm_k(h^k_i)])       [b, s, 2h] -> [b, s, h]
    h^{k+1} = final_norm_k(layer_k(x))                                  one decoder layer
    logits^k_i = h^{k+1}_i W_out^T                                      predicts t_{i+k+2}

``layer_k`` is a decoder layer of the model's own block class (``model.block``: pre-norm,
MiniMax's scaled residual, GLM-5's hyper-connections ...) with the kind ``model.mtp.layout``
gives, built as layer number ``num_layers + k`` (as the HF checkpoints number it), so its decode
cache, collective tags and router statistics never meet a main layer's. A family with its own
block (e.g. DeepSeek-V4's) plugs it in through ``layer_class``; the residual stream it carries
is entered and left through the block's ``enter_stream``/``leave_stream`` (or the depth's own
``stream_head`` where the block class builds one, as DeepSeek-V4's learned collapse).

Positions: depth k runs at the positions of its input tokens (the main positions plus k+1, as
transformers' ``MtpModel`` shifts them); a packed document's mask is the main one's.

Training (``train.mtp_loss_weight`` = lambda, DeepSeek-V3's definition): with D depths,
``L_MTP = lambda / D * sum_k CE_k``, CE_k the mean cross-entropy of depth k's targets (the labels
shifted by k+1; a target in another packed document is ignored). The last stage adds it to its
output's gradient (``attach_aux_loss``), so schedules and the main loss stay as they are.

Tensor parallelism: ``eh_proj`` is column-parallel with its output gathered (under sequence
parallelism its input sequence is gathered first and its output scattered back), the norms are
the layers' own role; everything else is the decoder layer's.

Shapes: hidden [b, s, h] ([b, s/tp, h] under SP), s = S/cp the local tokens; ids and labels
[b, S] full sequence.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from megamoe.core.config import ModelConfig
from megamoe.layers.mlp.router import attach_aux_loss
from megamoe.core.layout import LayerKind
from megamoe.parallel import comm
from megamoe.parallel.context import split_for_cp
from megamoe.parallel.cross_entropy import IGNORE_INDEX
from megamoe.layers.spec import BuildContext, ForwardInfo


class MTPDepth(nn.Module):
    """One depth: h^k [b, s, h] and the embedded tokens k+1 ahead [b, s, h] -> h^{k+1} [b, s, h]."""

    def __init__(self, kind: LayerKind, cfg: ModelConfig, ctx: BuildContext, block_cls, layer_number: int):
        super().__init__()
        self.config, self.block_cls, self.sp, self.group = cfg, block_cls, ctx.sp, ctx.groups.tp
        h, b = ctx.hidden_size, ctx.backend
        self.enorm = b.norm(ctx, h, sequence_parallel=True)
        self.hnorm = b.norm(ctx, h, sequence_parallel=True)
        # output gathered: every TP rank feeds the whole projection to the layer, as the main stack's input
        self.eh_proj = b.column_linear(ctx, 2 * h, h, gather_output=True)
        self.layer = block_cls(kind, cfg, ctx, layer_number)
        self.stream_head = block_cls.stream_head(cfg, ctx)  # a learned collapse of the streams, else leave_stream
        self.final_norm = b.norm(ctx, h, sequence_parallel=True)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.sp:  # the layer takes this rank's sequence chunk, as every layer under SP
            x = comm.scatter_to(x, 1, self.group)
        stream = self.layer(self.block_cls.enter_stream(x, self.config), info)
        x = self.block_cls.leave_stream(stream) if self.stream_head is None else self.stream_head(stream)
        return self.final_norm(x)


def build_depths(cfg: ModelConfig, ctx: BuildContext, block_cls) -> nn.ModuleList:
    """The MTP depths of ``cfg`` (``model.mtp``), numbered after the last layer."""
    first = ctx.num_layers
    return nn.ModuleList(MTPDepth(kind, cfg, ctx, block_cls, first + k) for k, kind in enumerate(cfg.mtp.kinds()))


def shift_tokens(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    """x [b, S] moved n steps left (x'[:, i] = x[:, i + n]), the last n filled with ``fill``."""
    out = torch.full_like(x, fill)
    if n < x.size(1):
        out[:, : x.size(1) - n] = x[:, n:]
    return out


def depth_labels(labels: torch.Tensor, depth: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Depth k's targets [b, S]: ``labels`` (next-token targets) shifted by k+1; a target in
    another packed document than its position (``documents`` [b, S]) is ignored."""
    out = shift_tokens(labels, depth + 1, IGNORE_INDEX)
    if documents is not None:
        out = out.masked_fill(shift_tokens(documents, depth + 1, -1) != documents, IGNORE_INDEX)
    return out


def depth_positions(positions: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth k's positions: those of its input tokens, k+1 ahead of the main ones."""
    return positions + (depth + 1)


def run_depth(model, depth: int, hidden: torch.Tensor, ahead_ids: torch.Tensor,
              info: ForwardInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth ``depth`` of ``model.mtp`` on this rank's tokens: h^k [b, s, h], the (local) token
    ids k+1 ahead [b, s], the main positions in ``info`` -> (h^{k+1}, vocab-parallel logits
    [b, s, V_pad/tp]). The depth's layer reads those ids as its tokens (hash-routed experts)."""
    info = dataclasses.replace(info, positions=depth_positions(info.positions, depth), memo={}, token_ids=ahead_ids)
    hidden = model.mtp[depth](hidden, model.embed(ahead_ids), info)
    return hidden, model.output(hidden)


@dataclass
class MTPTargets:
    """What the last stage needs to add the MTP loss: the full-sequence ``input_ids`` and
    ``labels`` [b, S] of the micro-batch and each depth's loss factor (``scales`` [D]:
    lambda / (D * that depth's target count over the global batch); ``depth_scales``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    scales: Sequence[float]


def depth_scales(weight: float, counts: Sequence[float]) -> list[float]:
    """lambda / (D * count_k) per depth (0 for a depth without targets)."""
    return [weight / (len(counts) * c) if c > 0 else 0.0 for c in counts]


def target_counts(labels: torch.Tensor, depths: int, documents: torch.Tensor | None = None) -> list[int]:
    """Each depth's number of targets in ``labels`` [b, S]."""
    return [int((depth_labels(labels, k, documents) != IGNORE_INDEX).sum()) for k in range(depths)]


def add_mtp_loss(model, logits: torch.Tensor, normed: torch.Tensor, targets: MTPTargets,
                 info: ForwardInfo) -> torch.Tensor:
    """The last stage's logits with the MTP loss attached to their gradient; each depth's loss
    sum over this rank's tokens is added to ``model.mtp_loss_sums`` (detached, [D]) for reporting."""
    hidden, total, sums = normed, logits.new_zeros(()), []
    for k in range(len(model.mtp)):
        ahead = split_for_cp(info.cp, shift_tokens(targets.input_ids, k + 1, 0))
        hidden, depth_logits = run_depth(model, k, hidden, ahead, info)
        s = model.loss_sum(depth_logits, depth_labels(targets.labels, k, info.documents))
        total = total + s * targets.scales[k]
        sums.append(s.detach().double())
    model.mtp_loss_sums = model.mtp_loss_sums + torch.stack(sums).cpu()
    return attach_aux_loss(logits, total)


def mtp_logits(model, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The main logits and every depth's, each [b, S, V] (gathered over TP), of a whole model
    (one pipeline stage): depth k at position i predicts token i+k+2; its last k+1 positions read
    filler ids (0) where the tokens ahead are unknown."""
    info = ForwardInfo(positions=model.default_positions(input_ids, None) if positions is None else positions)
    hidden = model.final_norm(model.run_layers(model.embed(input_ids), info))
    out = [model.gather_logits(model.output(hidden))]
    for k in range(len(model.mtp)):
        hidden, logits = run_depth(model, k, hidden, shift_tokens(input_ids, k + 1, 0), info)
        out.append(model.gather_logits(logits))
    return out
