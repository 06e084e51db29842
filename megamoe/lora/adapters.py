"""Adapter-carrying versions of the linear roles and the routed experts.

``attach`` turns a module into its LoRA subclass in place (``ColumnParallelLinear`` ->
``LoRAColumnParallelLinear``): the base parameters keep their objects and names, and the
adapter parameters are added beside them, so checkpoints, conversion tables and HF names of
the base weights are unchanged. The subclasses extend the base's ``local_linear`` (this
rank's product, before any reduction) or the experts' forward.

How each adapter is split, so that every layout computes the single-process function (full
shapes; ``g`` is the linear's group, normally ``tp``):

==================  ====================================  =====================================  ======================
base                lora_A                                lora_B                                 partial gradient
==================  ====================================  =====================================  ======================
column W [out, in]  [r, in] replicated                    [out, r] split like W's rows (by part)  A over g
row W [out, in]     [r, in] split like W's columns        [out, r] replicated                    B over g
replicated          whole                                 whole                                  -
experts W1 [E,2f,h] gate_up_lora_A [E, r, h] over ep      gate_up_lora_B [E, 2f, r] ep, etp      A over etp
experts W2 [E,h,f]  down_lora_A [E, r, f] ep, etp (dim 2)  down_lora_B [E, h, r] over ep          B over etp
shared experts      [r, h], [r, f] whole                  [2f, r], [h, r] whole                  all over tp (+dp_cp)
==================  ====================================  =====================================  ======================

Column: every rank multiplies the same x by A, then by its rows of B; each rank back-propagates
only its rows, so A's gradient is a partial sum (``mark_partial_grad``, summed by
``finalize_grads``). Row: rank t adds ``B A_t x_t`` to its partial output before the reduction
(exact: the reduction sums it to ``B A x``); B's gradient is then partial. Experts under ETP
are the same two cases over ``etp``. A shared expert adapter is used by the experts of every
rank (its ETP slice of B1/A2 is taken in the forward), so its gradient is partial over the
whole stage: marked over tp, and summed over dp_cp like any dense parameter. Per-expert
adapters are expert parameters (reduced over the expert-data-parallel group).

Init (PEFT's default): A uniform in +-1/sqrt(fan_in) (kaiming-uniform with a=sqrt(5)), B zero,
drawn from the full tensor like every parameter (``megamoe.weights.initialize``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.layers.experts import GroupedExperts
from megamoe.lora.config import LoRAConfig
from megamoe.lora.experts import ExpertLoRA, lora_swiglu_experts
from megamoe.params import mark_active_fraction
from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.record import record
from megamoe.parallel.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from megamoe.parallel.sharding import Shard, const_init, mark_init, mark_partial_grad, set_sharding, sharding, split_full

EXPERT_WEIGHTS = {"gate_up": "gate_up_weight", "down": "down_weight"}  # adapter prefix -> base weight
ADAPTER_NAMES = frozenset({"lora_A", "lora_B", *(f"{p}_lora_{x}" for p in EXPERT_WEIGHTS for x in "AB")})


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name (``layers.0.mixer.linear_qkv.lora_A``) is a LoRA factor."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def kaiming_uniform_init(fan_in: int):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as PEFT initialises lora_A."""
    bound = 1.0 / fan_in ** 0.5
    return lambda draw: draw.uniform().mul_(2 * bound).sub_(bound)


def _param(like: torch.Tensor, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device))


class _LoRAModule:
    """State shared by the adapter mixins: scale, dropout, merged."""

    lora_scale: float = 1.0
    lora_dropout: float = 0.0
    lora_merged: bool = False

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        for weight, delta in self.lora_deltas():
            weight.copy_((weight.float() + sign * delta).to(weight.dtype))

    def lora_merge(self) -> None:
        """Fold the adapter into the local base weights (the forward then skips it)."""
        if not self.lora_merged:
            self._fold(1.0)
            self.lora_merged = True

    def lora_unmerge(self) -> None:
        """Subtract the folded adapter again (exact up to rounding of the weight dtype)."""
        if self.lora_merged:
            self._fold(-1.0)
            self.lora_merged = False


class LoRALinear(_LoRAModule):
    """Mixin before a linear role: its rank-local product gains ``s * B A drop(x)``."""

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        y = super().local_linear(x)
        if self.lora_merged:
            return y
        if self.lora_dropout > 0:
            x = F.dropout(x, self.lora_dropout, self.training)
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale

    def lora_delta(self) -> torch.Tensor:
        """The local weight update ``s * B A`` (fp32), shaped like the local weight."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.lora_scale

    def lora_deltas(self):
        return [(self.weight, self.lora_delta())]

    def effective_weight(self) -> torch.Tensor:
        w = super().effective_weight()
        return w if self.lora_merged else w + self.lora_delta().to(w.dtype)


class LoRAExperts(_LoRAModule):
    """Mixin before ``GroupedExperts``: the expert maths with adapters (``megamoe.lora.experts``)."""

    lora_groups: ParallelGroups | None = None

    def lora_factors(self) -> ExpertLoRA:
        """This rank's factors; a shared adapter contributes the ETP slice of its f dim."""
        a1, b1, a2, b2 = (getattr(self, f"{p}_lora_{x}") for p in EXPERT_WEIGHTS for x in "AB")
        if a1.dim() == 2 and self.lora_groups is not None:
            f = self.down_weight.size(2) * self.lora_groups.size("etp")
            b1 = split_full(b1, (Shard(0, "etp", (f, f)),), self.lora_groups)
            a2 = split_full(a2, (Shard(1, "etp"),), self.lora_groups)
        return ExpertLoRA(a1, b1, a2, b2, self.lora_scale, self.lora_dropout, self.training)

    def forward(self, x, idx, counts, probs, out_rows):
        if self.lora_merged:
            return super().forward(x, idx, counts, probs, out_rows)
        return lora_swiglu_experts(x, idx, counts, probs, self.gate_up_weight, self.down_weight, self.lora_factors(),
                                   out_rows, self.swiglu_limit)

    def lora_deltas(self):
        f = self.lora_factors()
        return [(self.gate_up_weight, torch.matmul(f.b1.float(), f.a1.float()) * f.scale),
                (self.down_weight, torch.matmul(f.b2.float(), f.a2.float()) * f.scale)]

    def effective_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W1, W2) with the adapters folded in (fp32 when not merged)."""
        if self.lora_merged:
            return self.gate_up_weight, self.down_weight
        (w1, d1), (w2, d2) = self.lora_deltas()
        return w1.float() + d1, w2.float() + d2


class LoRAColumnParallelLinear(LoRALinear, ColumnParallelLinear):
    pass


class LoRARowParallelLinear(LoRALinear, RowParallelLinear):
    pass


class LoRAReplicatedLinear(LoRALinear, ReplicatedLinear):
    pass


class LoRAGroupedExperts(LoRAExperts, GroupedExperts):
    pass


LORA_CLASSES = {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear,
                ReplicatedLinear: LoRAReplicatedLinear, GroupedExperts: LoRAGroupedExperts}


def is_adaptable(module: nn.Module) -> bool:
    return type(module) in LORA_CLASSES


def has_lora(module: nn.Module) -> bool:
    return isinstance(module, _LoRAModule)


# ---- attaching ---------------------------------------------------------------------------

def _attach_linear(m: nn.Module, cfg: LoRAConfig) -> None:
    rules = sharding(m.weight)
    out_local, in_local = m.weight.shape
    m.lora_A, m.lora_B = _param(m.weight, cfg.rank, in_local), _param(m.weight, out_local, cfg.rank)
    if any(r.dim == 0 for r in rules):  # column-parallel: B split like W's rows, A's gradient partial
        set_sharding(m.lora_B, *rules)
        for r in rules:
            mark_partial_grad(m.lora_A, r.group)
    elif rules:  # row-parallel: A split like W's columns, B's gradient partial
        set_sharding(m.lora_A, *rules)
        for r in rules:
            mark_partial_grad(m.lora_B, r.group)
    mark_init(m.lora_A, kaiming_uniform_init(m.in_features))
    mark_init(m.lora_B, const_init(0.0))


def _attach_experts(m: nn.Module, cfg: LoRAConfig, groups: ParallelGroups) -> None:
    e, _, h = m.gate_up_weight.shape
    f_local = m.down_weight.size(2)
    f, r, w = f_local * groups.size("etp"), cfg.rank, m.gate_up_weight
    if cfg.expert_adapters == "per_expert":
        params = {"gate_up_lora_A": (_param(w, e, r, h), [Shard(0, "ep")], h),
                  "gate_up_lora_B": (_param(w, e, 2 * f_local, r), [Shard(0, "ep"), Shard(1, "etp", (f, f))], None),
                  "down_lora_A": (_param(w, e, r, f_local), [Shard(0, "ep"), Shard(2, "etp")], f),
                  "down_lora_B": (_param(w, e, h, r), [Shard(0, "ep")], None)}
        for name in ("gate_up_lora_A", "down_lora_B"):  # replicated over the expert's etp slices
            mark_partial_grad(params[name][0], "etp")
    else:  # one pair for every expert, whole on every rank
        params = {"gate_up_lora_A": (_param(w, r, h), [], h), "gate_up_lora_B": (_param(w, 2 * f, r), [], None),
                  "down_lora_A": (_param(w, r, f), [], f), "down_lora_B": (_param(w, h, r), [], None)}
    fraction = record(w).active_fraction
    for name, (p, rules, fan_in) in params.items():
        set_sharding(p, *rules)
        mark_init(p, kaiming_uniform_init(fan_in) if fan_in else const_init(0.0))
        if rules:  # per-expert: sharded over ep (and etp), hence an expert parameter
            mark_active_fraction(p, fraction)
        else:  # used by the experts of every rank: the stage's ranks each hold a partial gradient
            mark_partial_grad(p, "tp")
        setattr(m, name, p)
    m.lora_groups = groups


def attach(module: nn.Module, cfg: LoRAConfig, groups: ParallelGroups) -> None:
    """Turn ``module`` (a linear role or routed experts) into its LoRA subclass, in place."""
    base = type(module)
    module.__class__ = LORA_CLASSES[base]
    if base is GroupedExperts:
        _attach_experts(module, cfg, groups)
    else:
        _attach_linear(module, cfg)
    module.lora_scale, module.lora_dropout, module.lora_merged = cfg.scale, cfg.dropout, False
