"""The lightning indexer's training objective (DeepSeek-V3.2, section 2.1), for any mixer whose
attention reads keys an indexer selects (DSA's ``D``/``I``; reusable by other indexers).

For query t, the target is the main attention's distribution over the candidate keys: the
attention probabilities summed over all heads and L1-normalised, ``p[t, :]``; the indexer's
distribution is the softmax of its scores ``I[t, :]`` over the same candidates; the loss is
``KL(p[t, :] || softmax(I[t, :]))`` summed over queries. Two stages:

- dense warm-up: the candidates are every key the query may see (causal, its document); the
  attention stays dense and the rest of the model is frozen;
- sparse training: the candidates are the keys the indexer selected, ``S_t``; both
  distributions are restricted to them (and renormalised).

The target carries no gradient, and the indexer's inputs are detached by the mixer, so the KL
trains the indexer only and the language-model loss trains the rest only. The loss reaches
the gradient without the caller adding it: ``IndexerObjective.attach`` hangs it on the mixer's
output (as the MoE balancing losses are, ``attach_aux_loss``), scaled by ``scale`` (the trainer
sets ``loss_coeff / query tokens in the global batch``: the mean over queries, the same at every
layout). Under TP each rank holds some heads: the head sums are all-reduced, so every rank
computes the same target and the replicated indexer the same gradient.

Shapes: ``b`` batch, ``s`` this rank's queries, ``N`` candidates (keys, or GLM-5's pools).
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.layers.mlp.router import attach_aux_loss
from megamoe.parallel import comm

MODES = ("off", "warmup", "sparse")


def head_summed_probs(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Attention scores [b, s, H, T] (scaled logits of this rank's heads), allowed [b or 1, s, T]
    -> the softmax over allowed keys summed over the heads [b, s, T] (fp32; 0 where not allowed)."""
    scores = scores.float().masked_fill(~allowed.unsqueeze(2), float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no allowed key: all 0
    return p.sum(dim=2)


def attention_target(head_sum: torch.Tensor, tp_group=None) -> torch.Tensor:
    """[b, s, N] head-summed probabilities of this rank's heads -> of all heads (all-reduced
    over TP), L1-normalised per query (0 rows stay 0)."""
    total = comm.all_reduce_tensor(head_sum.contiguous(), tp_group)
    return total / total.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def indexer_kl(index_scores: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``KL(target || softmax(index_scores))`` over the valid candidates of each query, both
    restricted to them: index_scores [b, s, N] (differentiable), target [b, s, N] (>= 0),
    valid [b, s, N] bool -> [b, s] (0 for a query without a valid candidate)."""
    t = torch.where(valid, target.float(), 0.0)
    t = t / t.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(index_scores.float().masked_fill(~valid, float("-inf")), dim=-1)
    log_q = torch.where(valid, log_q, 0.0)  # (-inf outside: t is 0 there)
    return (torch.xlogy(t, t) - t * log_q).sum(dim=-1)


class IndexerObjective(nn.Module):
    """A mixer's hook for training its indexer: the trainer sets ``mode`` and ``scale``; the mixer
    asks ``active`` and hangs its per-query KL on its output with ``attach``. Records the KL
    sum and the number of queries for the metrics (``megamoe.training.indexer``)."""

    def __init__(self, layer_number: int = 0):
        super().__init__()
        self.layer_number, self.mode, self.scale = layer_number, "off", 1.0
        self.stats: dict[str, torch.Tensor] = {}

    def active(self, module: nn.Module) -> bool:
        """Whether this forward trains the indexer: a mode is set, and it is a training forward."""
        return self.mode != "off" and module.training and torch.is_grad_enabled()

    def attach(self, out: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
        """``out`` unchanged; in backward, ``kl.sum()`` gets the gradient ``scale``."""
        total = kl.sum()
        with torch.no_grad():
            new = {"kl_sum": total.detach().double().cpu(), "queries": torch.tensor(float(kl.numel()), dtype=torch.float64)}
            for k, v in new.items():
                self.stats[k] = v if k not in self.stats else self.stats[k] + v
        return attach_aux_loss(out, total, self.scale)

    def extra_repr(self) -> str:
        return f"layer={self.layer_number}, mode={self.mode}"
