"""Top-k router: fp32 scores, group-limited selection, aux-loss-free bias, balancing losses.

Shapes: x [T, h] (this rank's tokens, T = b * s_local), logits/scores [T, E], top-k
weights/indices [T, k].

Token shards. Under TP the MoE layer routes a sequence shard per TP rank (sequence
parallelism, or its own split without it; likewise CP), so statistics that need the whole
micro-batch (tokens per expert) are summed over those ranks. Each balancing loss is computed
as this rank's share (its tokens' probabilities against the micro-batch counts); the shares
add up to the loss of the whole micro-batch, and the router weight's gradient is a partial
sum over TP (``mark_tp_partial_grad``).

Losses reach the gradient without the caller adding them to the loss: the MoE layer attaches
them to its output with ``attach_aux_loss`` (Megatron's MoEAuxLossAutoScaler idea), so they
work per pipeline stage. Their values are recorded for ``megamoe.model.moe_controls.moe_metrics``.

The expert bias (``expert_bias``, fp32, a non-trainable parameter so it is initialised,
checkpointed and converted with the weights) only shifts which experts are selected; the
weights come from the unbiased scores. ``update_bias`` applies the step's accumulated load,
summed over every rank of the pipeline stage, so all data-parallel replicas stay identical.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.core.config import MoEConfig
from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups, group_size
from megamoe.parallel.record import update_record
from megamoe.parallel.sharding import const_init, mark_init, mark_tp_partial_grad, normal_init
from megamoe.layers.spec import BuildContext


# ---- pure routing maths ------------------------------------------------------------------

def scores_from_logits(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """[T, E] fp32 logits -> scores: softmax over experts, or per expert a sigmoid or
    sqrt(softplus) (DeepSeek-V4)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_function == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return torch.sigmoid(logits)


def group_limited(choice: torch.Tensor, n_group: int, topk_group: int, group_score_topk: int) -> torch.Tensor:
    """Mask (-inf) experts outside each token's best ``topk_group`` of ``n_group`` groups.

    A group's score is the sum of its ``group_score_topk`` best scores (DeepSeek-V3: 2).
    choice: [T, E] -> [T, E].
    """
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    group_scores = grouped.topk(group_score_topk, dim=-1).values.sum(-1)  # [T, n_group]
    best = group_scores.topk(topk_group, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(t, e)


def select_experts(scores: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None = None):
    """Top-k experts per token. Returns (weights [T, k] fp32, indices [T, k] long).

    ``bias`` (aux-loss-free balancing) is added for the choice only; weights are gathered from
    the unbiased scores, renormalised if ``norm_topk_prob`` and scaled by
    ``routed_scaling_factor``.
    """
    choice = scores.detach() if bias is None else scores.detach() + bias
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        choice = group_limited(choice, cfg.n_group, cfg.topk_group, cfg.group_score_topk)
    idx = choice.topk(cfg.top_k, dim=-1).indices
    return routed_weights(scores, idx, cfg), idx


def routed_weights(scores: torch.Tensor, idx: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """The weights [T, k] of the chosen experts idx [T, k]: their scores [T, E], renormalised if
    ``norm_topk_prob``, times ``routed_scaling_factor``."""
    weights = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:  # (times 1.0 is the same values, one op less per step)
        weights = weights * cfg.routed_scaling_factor
    return weights


def balance_probs(scores: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-token distributions over experts used by the balancing losses and the entropy:
    softmax scores as they are, sigmoid scores normalised to sum to one."""
    if score_function == "softmax":
        return scores
    return scores / (scores.sum(-1, keepdim=True) + 1e-20)


def bin_counts(flat: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[num_bins] long: how often each value of ``flat`` (all in [0, num_bins)) occurs. A scatter,
    not ``bincount``: its output size is known without reading the data, so a compiled graph
    holds it."""
    return torch.zeros(num_bins, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def positions_in_bins(flat: torch.Tensor, order: torch.Tensor, num_bins: int) -> torch.Tensor:
    """[n] long: each element's position among the elements of its bin (``flat``'s value, in
    [0, num_bins)), counted in ``order`` (a permutation that sorts ``flat`` by bin), in ``flat``'s
    own order. All on the device, static shapes."""
    counts = bin_counts(flat, num_bins)
    starts = torch.cumsum(counts, 0) - counts
    ranked = torch.arange(flat.numel(), device=flat.device) - starts.index_select(0, flat.index_select(0, order))
    return torch.empty_like(flat).index_copy_(0, order, ranked)


def capacity_keep(weights: torch.Tensor, idx: torch.Tensor, num_experts: int, capacity: int,
                  policy: str) -> torch.Tensor:
    """[T, k] bool: which (token, slot) pairs fit in each expert's ``capacity``.

    policy ``probs`` keeps each expert's highest-weight pairs, ``position`` its earliest tokens.
    """
    flat_e = idx.reshape(-1)
    if policy == "probs":  # order by expert, then by descending weight
        order = torch.argsort(-weights.detach().reshape(-1), stable=True)
        order = order[torch.argsort(flat_e[order], stable=True)]
    else:
        order = torch.argsort(flat_e, stable=True)
    return (positions_in_bins(flat_e, order, num_experts) < capacity).view_as(idx)


# ---- attaching losses to the gradient ----------------------------------------------------

class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux_loss`` gets the gradient ``scale`` as if it had
    been added (times ``scale``) to the final loss."""

    @staticmethod
    def forward(ctx, out, aux_loss, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(out: torch.Tensor, aux_loss: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor:
    if aux_loss is None or not aux_loss.requires_grad:
        return out
    return _AttachAuxLoss.apply(out, aux_loss, scale)


# ---- the router module -------------------------------------------------------------------

@dataclass
class Routing:
    weights: torch.Tensor  # [T, k] fp32 (carries the router's gradient)
    idx: torch.Tensor  # [T, k] long, global expert ids
    keep: torch.Tensor | None  # [T, k] bool under a capacity, None when dropless
    aux_loss: torch.Tensor | None  # this rank's share of the weighted balancing + z losses


class TopKRouter(nn.Module):
    """Routes [T, h] tokens. ``aux_loss_scale`` multiplies the injected loss gradients (set it to
    the factor the trainer applies to the main loss, e.g. 1 / micro-batches)."""

    def __init__(self, cfg: MoEConfig, ctx: BuildContext, layer_number: int = 0):
        super().__init__()
        self.cfg, self.layer_number = cfg, layer_number
        self.groups = ctx.groups
        # ranks that hold other tokens of the same micro-batch (sequence shards)
        self.shard_groups = [g for g in (ctx.groups.tp, ctx.groups.cp) if group_size(g) > 1]
        self.shards = ctx.groups.tp_size * ctx.groups.size("cp")
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, ctx.hidden_size, dtype=ctx.dtype,
                                               device=ctx.device))
        self.gemm = ctx.backend.router_logits(ctx)  # (x, weight) -> fp32 logits
        mark_init(self.weight, normal_init(ctx.init_std))
        if ctx.groups.tp_size > 1:
            mark_tp_partial_grad(self.weight)
        if cfg.expert_bias:
            bias = torch.empty(cfg.num_experts, dtype=torch.float32, device=ctx.device)
            self.expert_bias = nn.Parameter(bias, requires_grad=False)
            mark_init(self.expert_bias, const_init(0.0))
        else:
            self.register_parameter("expert_bias", None)
        self.update_rate = cfg.expert_bias_update_rate
        self.aux_loss_scale = 1.0
        self.load = None  # [E] fp32 tokens per expert since the last bias update (training only)
        self.stats: dict[str, torch.Tensor] = {}  # accumulated since the last moe_metrics read
        # False: forwards outside training leave ``stats`` alone (set by ``megamoe.model.moe_controls.recording``;
        # decoding turns it off: its per-token statistics were ~120 small ops per step)
        self.record_stats = True

    # -- forward -------------------------------------------------------------------------

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight)

    def forward(self, x: torch.Tensor, batch: int, token_ids: torch.Tensor | None = None) -> Routing:
        """x: [T, h] with T = batch * s_local tokens in batch-major order; token_ids [T] their ids
        (read by the hash router only)."""
        cfg = self.cfg
        logits = self.logits(x)
        scores = scores_from_logits(logits, cfg.score_function)
        weights, idx = self.choose(scores, token_ids)
        keep = None
        if cfg.capacity_factor is not None:
            capacity = max(1, math.ceil(cfg.capacity_factor * x.size(0) * cfg.top_k / cfg.num_experts))
            keep = capacity_keep(weights, idx, cfg.num_experts, capacity, cfg.drop_policy)
        training = self.training and torch.is_grad_enabled()
        if not (training or self.record_stats):
            return Routing(weights, idx, keep, None)
        probs = balance_probs(scores, cfg.score_function)
        counts = self._count(idx)  # [E] this rank's tokens per expert (before dropping)
        aux = self._losses(logits, probs, idx, counts, batch) if training else {}
        self._record(counts, probs, keep, aux, training)
        total = None
        for name, value in aux.items():
            coeff = getattr(cfg, f"{name}_coeff")
            total = value * coeff if total is None else total + value * coeff
        return Routing(weights, idx, keep, total)

    def choose(self, scores: torch.Tensor, token_ids: torch.Tensor | None):
        """(weights [T, k] fp32, expert ids [T, k]) from the scores [T, E]: the top k."""
        bias = None if self.expert_bias is None else self.expert_bias.detach().float()
        return select_experts(scores, self.cfg, bias)

    def _count(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.bincount(idx.reshape(-1), minlength=self.cfg.num_experts).float()

    def _reduce_shards(self, t: torch.Tensor) -> torch.Tensor:
        for g in self.shard_groups:
            t = comm.all_reduce_tensor(t, g)
        return t

    def _losses(self, logits, probs, idx, counts, batch: int) -> dict[str, torch.Tensor]:
        """This rank's shares of the enabled losses (unweighted), by config name."""
        cfg, e, k = self.cfg, self.cfg.num_experts, self.cfg.top_k
        total_tokens = logits.size(0) * self.shards
        out = {}
        if cfg.aux_loss_coeff > 0:
            global_counts = self._reduce_shards(counts.clone())
            out["aux_loss"] = (probs.sum(0) * global_counts).sum() * e / (k * total_tokens ** 2)
        if cfg.seq_aux_loss_coeff > 0:
            seq_len = logits.size(0) // batch * self.shards
            per_seq = torch.zeros(batch, e, device=idx.device)
            per_seq.scatter_add_(1, idx.view(batch, -1), torch.ones_like(idx.view(batch, -1), dtype=torch.float))
            per_seq = self._reduce_shards(per_seq)
            p_seq = probs.view(batch, -1, e).sum(1)  # [b, E]
            out["seq_aux_loss"] = (p_seq * per_seq).sum() * e / (k * seq_len ** 2 * batch)
        if cfg.z_loss_coeff > 0:
            out["z_loss"] = torch.logsumexp(logits, dim=-1).square().sum() / total_tokens
        return out

    @torch.no_grad()
    def _record(self, counts, probs, keep, aux, training: bool) -> None:
        if training:  # the load the expert-bias update will use
            self.load = counts.clone() if self.load is None else self.load + counts
        entropy = -(probs * torch.log(probs.clamp_min(1e-20))).sum()
        new = {"tokens": counts, "entropy_sum": entropy, "num_tokens": probs.new_tensor(float(probs.size(0))),
               "dropped": probs.new_tensor(0.0) if keep is None else (~keep).sum().float(),
               "forwards": probs.new_tensor(1.0)}
        new.update({name: v.detach().float() for name, v in aux.items()})
        for name, v in new.items():
            self.stats[name] = v.clone() if name not in self.stats else self.stats[name] + v

    # -- outside autograd ----------------------------------------------------------------

    @torch.no_grad()
    def update_bias(self, groups: ParallelGroups | None = None) -> torch.Tensor | None:
        """Move the expert bias towards balance from the accumulated load; returns the load
        used ([E], summed over every rank of this stage), or None if there is nothing to do."""
        if self.expert_bias is None or self.load is None:
            return None
        groups = groups or self.groups
        load = self.load
        for g in (groups.tp, groups.dp_cp):  # every rank of the stage holds different tokens
            load = comm.all_reduce_tensor(load, g)
        if self.expert_bias.dtype != torch.float32:  # keep fp32 even if the model was cast
            self.expert_bias.data = self.expert_bias.data.float()
        self.expert_bias.add_(torch.sign(load.mean() - load) * self.update_rate)
        self.load = None
        return load


class HashRouter(TopKRouter):
    """DeepSeek-V4's hash routing (layout letter ``h``): token id t goes to the experts
    ``table[t]`` [k], a frozen table over the vocabulary (``tid2eid``; a non-trainable parameter,
    so it is initialised, checkpointed and converted with the weights). The router's scores only
    weight them (renormalised, scaled, as top-k routing does). No selection bias.

    Default table (a model trained from scratch): ``table[t, j] = (t k + j) mod E``, k different
    experts per token when k <= E."""

    def __init__(self, cfg: MoEConfig, ctx: BuildContext, layer_number: int = 0):
        super().__init__(cfg, ctx, layer_number)
        if self.expert_bias is not None:  # hash layers choose by table, never by score
            del self.expert_bias
            self.register_parameter("expert_bias", None)
        if ctx.vocab_size <= 0:
            raise ValueError("a hash-routed MoE layer needs the vocabulary size (BuildContext.vocab_size)")
        table = torch.empty(ctx.vocab_size, cfg.top_k, dtype=torch.long, device=ctx.device)
        self.table = nn.Parameter(table, requires_grad=False)
        experts = cfg.num_experts
        mark_init(self.table, lambda draw: (draw.index % experts).float())
        update_record(self.table, active_fraction=1 / ctx.vocab_size)  # a token reads its own row

    def choose(self, scores: torch.Tensor, token_ids: torch.Tensor | None):
        if token_ids is None:
            raise ValueError(f"MoE layer {self.layer_number} routes by token id (hash routing) but the forward "
                             f"got no token ids (ForwardInfo.token_ids)")
        idx = self.table[token_ids.reshape(-1)]
        return routed_weights(scores, idx, self.cfg), idx
