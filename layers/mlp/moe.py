"""Mixture of experts (layout letter ``e``): router, token dispatch, routed and shared experts.

x: [b, s, h] (``[b, s/tp, h]`` under sequence parallelism) -> same shape::

    out = sum_{e in topk(x)} w_e(x) * expert_e(x)  +  [sigmoid(x W_g)] * shared(x)

Token flow. The router and the routed experts work on the tokens a rank owns. Under
sequence parallelism each TP rank already owns a sequence shard. Without it the residual
stream is replicated over TP, so the layer splits the sequence over TP itself (backward:
the input gradient is all-gathered) and all-gathers the routed output (backward: each rank
keeps its shard's gradient); no expert work is duplicated. The shard's tokens then go to
the expert grid (``ep`` x ``etp``) with the configured dispatcher. Shared experts are a
plain TP SwiGLU on the residual stream, as attention's MLP would be.

Inference with a sequence that does not split over TP (decoding one token at TP>1) routes
the replicated tokens on every TP rank: the result is the same, the expert work repeats.

With ``model.moe.redundant_experts=N`` the hottest experts have copies on other EP ranks and each
pair goes to one copy (``megamoe.layers.mlp.replicas``); the outputs do not change.

Letter ``h`` is the same layer routed by token id (``HashRouter``, DeepSeek-V4's first layers):
the router's scores weight the experts a frozen table gives each token; it reads the token ids
of its own tokens (``ForwardInfo.token_ids``, cut like the tokens).

Parameters: router E*h (+ E for the expert bias), routed experts 3*E*h*f (top_k/E of them
active per token), shared experts 3*h*f_shared, shared gate h; a hash layer's table V*k
(integers, frozen) instead of the expert bias.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.core.config import MLPConfig, MoEConfig
from megamoe.parallel import comm
from megamoe.parallel.groups import group_rank
from megamoe.parallel.sharding import mark_init, mark_tp_partial_grad, normal_init
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mlp
from megamoe.layers.mlp.static_dispatch import build_dispatcher
from megamoe.layers.mlp.dense import glu_of
from megamoe.layers.mlp.replicas import ExpertReplicas
from megamoe.layers.mlp.router import HashRouter, TopKRouter, attach_aux_loss


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, ctx: BuildContext, layer_number: int = 0, *, router: type = TopKRouter):
        super().__init__()
        self.cfg, self.layer_number = cfg, layer_number
        self.tp, self.tp_size = ctx.groups.tp, ctx.groups.tp_size
        self.sp = ctx.sp
        self.split_tokens = self.tp_size > 1 and not ctx.sp
        self.router = router(cfg, ctx, layer_number)
        self.experts = ctx.backend.grouped_experts(ctx, cfg.num_experts, cfg.moe_ffn_hidden_size,
                                                   kernel=cfg.expert_kernel,
                                                   active_fraction=cfg.top_k / cfg.num_experts,
                                                   glu=glu_of(cfg), store=cfg.expert_store)
        # redundant hot experts: the dispatcher works on the E + N slots (megamoe.layers.mlp.replicas)
        self.replicas = ExpertReplicas.of(cfg.num_experts, cfg.replica_experts(layer_number), ctx.groups)
        slots = cfg.num_experts if self.replicas is None else self.replicas.num_slots
        self.dispatch = build_dispatcher(cfg, ctx.groups, slots)
        shared = cfg.shared_ffn()
        self.shared_experts = (ctx.backend.shared_expert(ctx, MLPConfig(ffn_hidden_size=shared,
                                                                        swiglu_limit=cfg.swiglu_limit,
                                                                        swiglu_alpha=cfg.swiglu_alpha), layer_number)
                               if shared else None)
        if cfg.shared_expert_gate:
            self.shared_gate = nn.Parameter(torch.empty(1, ctx.hidden_size, dtype=ctx.dtype, device=ctx.device))
            mark_init(self.shared_gate, normal_init(ctx.init_std))
            if ctx.sp:  # each rank gates its own sequence shard
                mark_tp_partial_grad(self.shared_gate)
        else:
            self.register_parameter("shared_gate", None)

    def forward(self, x: torch.Tensor, info: ForwardInfo | None = None) -> torch.Tensor:
        ids = None if info is None else info.token_ids
        if ids is not None and self.sp:  # [b, s] -> this rank's sequence shard, as x
            ids = ids.chunk(self.tp_size, dim=1)[group_rank(self.tp)] if ids.size(1) != x.size(1) else ids
        if self.shared_experts is None:
            return self.routed(x, ids)
        if not self.cfg.shared_expert_overlap:
            return self.shared_experts.add_to(self.routed(x, ids), x, self.shared_gate)
        # computed by the dispatcher while its all-to-alls are in flight: fc1 during the dispatch's,
        # fc2 during the combine's (and in backward the other way round)
        first, second = self.shared_experts.two_parts(x, self.shared_gate)
        shared: list[torch.Tensor] = []
        out = self.routed(x, ids, during=(first, lambda: shared.append(second())))
        return out + shared[0]

    def routed(self, x: torch.Tensor, ids: torch.Tensor | None = None, during=None) -> torch.Tensor:
        """The routed experts' part: [b, s, h] -> [b, s, h] (with its aux losses attached);
        ids [b, s]: the tokens' ids (hash routing); ``during``: work the dispatcher runs while
        its token exchange is in flight (once, in any case): a callable, or a pair (during the
        dispatch, during the combine)."""
        split = self.split_tokens and self._can_split(x)
        if split:
            x = comm.scatter_to(x, 1, self.tp)
            ids = None if ids is None else ids.chunk(self.tp_size, dim=1)[group_rank(self.tp)]
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        routing = self.router(flat, b, None if ids is None else ids.reshape(-1))
        idx, experts = routing.idx, self.experts
        if self.replicas is not None:  # each pair to one copy of its expert; the replicas' weights fetched
            idx, experts = self.replicas.route(idx, routing.keep), self.replicas.bind(self.experts)
        y = self.dispatch(flat, routing.weights, idx, routing.keep, experts, during).view(b, s, h)
        y = attach_aux_loss(y, routing.aux_loss, self.router.aux_loss_scale)
        return comm.gather_from(y, 1, self.tp) if split else y

    def _can_split(self, x: torch.Tensor) -> bool:
        if x.size(1) % self.tp_size == 0:
            return True
        if self.training and torch.is_grad_enabled():
            raise ValueError(f"MoE layer {self.layer_number}: sequence length {x.size(1)} must be divisible by "
                             f"parallel.tp={self.tp_size} when training (tokens are split over TP)")
        return False


register_mlp("e", ModuleSpec(MoELayer))
register_mlp("h", ModuleSpec(MoELayer, params={"router": HashRouter}))
