"""LoRA as an adapter role around whatever linear or expert role a backend returned.

``attach`` wraps a role in place, without changing its class: the adapter factors become
parameters of the role itself beside its base weights (``linear_qkv.lora_A`` next to
``linear_qkv.weight``), so checkpoints, conversion tables and HF names of the base weights are
unchanged, and an ``Adapter`` object (``role.lora_adapter``) takes over the role's kernel entry
points, calling the backend's own version inside:

- a linear role (column, row or replicated, of any backend: a ``weight`` and ``local_linear(x)``,
  this rank's product before any reduction): ``local_linear`` gains ``s * B A drop(x)`` and
  ``effective_weight()`` (the local weight as it multiplies; MLA's absorbed decode reads it)
  gains ``s * B A``. The role's own communication and GEMM (plain, FP8, Transformer Engine)
  stay as they are around and inside it;
- a routed-experts role (``gate_up_weight``, ``down_weight``, ``glu``, ``compute(x, idx,
  counts, probs, w1, w2, out_rows, experts)``: the kernel on given weights, ``resolved_kernel()``):
  ``compute`` runs the adapters' form of the role's kernel (``megamoe.lora.experts``) on the
  weights the role's forward brings (its own, or a tiered role's experts read from the store);
  merged, the role's own kernel again. Tiered experts (weights ``stored``) cannot be merged.

Which kind a role is comes from the role's interface and its weights' ``ParamRecord`` (shard
rules over the group), never from its class: any backend's roles get LoRA.

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
drawn from the full tensor like every parameter (``megamoe.model.weights.initialize``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.core.errors import ConfigError
from megamoe.model.fp8_base import is_fp8, thaw
from megamoe.lora.config import LoRAConfig
from megamoe.lora.experts import ExpertLoRA, lora_swiglu_experts
from megamoe.parallel.groups import ParallelGroups
from megamoe.parallel.record import mark_active_fraction, record
from megamoe.parallel.sharding import (Shard, const_init, full_shape, mark_init, mark_partial_grad, set_sharding,
                                      sharding, split_full)

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


# ---- which roles can carry an adapter ------------------------------------------------------

def role_kind(module: nn.Module) -> str | None:
    """``"linear"``, ``"experts"`` or None, from the role's interface (see the module docstring)."""
    if isinstance(getattr(module, "weight", None), torch.Tensor) and callable(getattr(module, "local_linear", None)):
        return "linear"
    if all(isinstance(getattr(module, w, None), torch.Tensor) for w in EXPERT_WEIGHTS.values()):
        return "experts"
    return None


def adapter_of(module: nn.Module) -> Adapter | None:
    """The adapter wrapping ``module`` (None if it carries none)."""
    adapter = module.__dict__.get("lora_adapter")
    return adapter if isinstance(adapter, Adapter) else None


def is_adaptable(module: nn.Module) -> bool:
    return role_kind(module) is not None


def has_lora(module: nn.Module) -> bool:
    return adapter_of(module) is not None


# ---- the adapter roles ---------------------------------------------------------------------

class Adapter:
    """What the linear and expert adapters share: the role they wrap, scale, dropout, merged.
    The factors are the role's parameters (read from it at every call, so moving or loading
    the model is seen)."""

    def __init__(self, role: nn.Module, cfg: LoRAConfig):
        self.role, self.scale, self.dropout, self.merged = role, cfg.scale, cfg.dropout, False

    def deltas(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(local base weight, its fp32 update) pairs."""
        raise NotImplementedError

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        for weight, delta in self.deltas():
            weight.copy_((weight.float() + sign * delta).to(weight.dtype))

    def merge(self) -> None:
        """Fold the adapter into the local base weights (the role's own kernel then runs alone).
        A frozen FP8 base (``megamoe.model.fp8_base``) is dequantised first: the merged weight is float."""
        if not self.merged:
            if is_fp8(self.role):
                self.rebind(thaw(self.role))
            self._fold(1.0)
            self.merged = True

    def rebind(self, own: dict) -> None:
        """Take the role's own entry points (``own``, by name, from ``thaw``) as the base again."""

    def unmerge(self) -> None:
        """Subtract the folded adapter again (exact up to rounding of the weight dtype)."""
        if self.merged:
            self._fold(-1.0)
            self.merged = False


class LinearAdapter(Adapter):
    """Around a linear role: its rank-local product gains ``s * B A drop(x)``.

    x [..., in_local] -> [..., out_local]; lora_A [r, in_local], lora_B [out_local, r]."""

    def __init__(self, role: nn.Module, cfg: LoRAConfig):
        super().__init__(role, cfg)
        self.base_product, self.base_weight = role.local_linear, role.effective_weight  # the backend's own

    def rebind(self, own: dict) -> None:
        self.base_product, self.base_weight = own["local_linear"], own["effective_weight"]

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_product(x)
        if self.merged:
            return y
        role = self.role
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, role.training)
        return y + F.linear(F.linear(x, role.lora_A), role.lora_B) * self.scale

    def delta(self) -> torch.Tensor:
        """The local weight update ``s * B A`` (fp32), shaped like the local weight."""
        return (self.role.lora_B.float() @ self.role.lora_A.float()) * self.scale

    def deltas(self):
        return [(self.role.weight, self.delta())]

    def effective_weight(self) -> torch.Tensor:
        w = self.base_weight()
        return w if self.merged else w + self.delta().to(w.dtype)


class ExpertAdapter(Adapter):
    """Around a routed-experts role: ``forward(x, idx, counts, probs, out_rows)`` with the
    adapters inside each expert's SwiGLU (``megamoe.lora.experts``), in the form of the role's
    kernel (``resolved_kernel()``: the reference loop, the loop kernel or torch's grouped GEMM)."""

    def __init__(self, role: nn.Module, cfg: LoRAConfig, groups: ParallelGroups):
        super().__init__(role, cfg)
        self.groups, self.base_compute = groups, role.compute

    def factors(self) -> ExpertLoRA:
        """This rank's factors; a shared adapter contributes the ETP slice of its f dim."""
        role = self.role
        a1, b1, a2, b2 = (getattr(role, f"{p}_lora_{x}") for p in EXPERT_WEIGHTS for x in "AB")
        if a1.dim() == 2:
            f = role.down_weight.size(2) * self.groups.size("etp")
            b1 = split_full(b1, (Shard(0, "etp", (f, f)),), self.groups)
            a2 = split_full(a2, (Shard(1, "etp"),), self.groups)
        return ExpertLoRA(a1, b1, a2, b2, self.scale, self.dropout, role.training)

    def compute(self, x, idx, counts, probs, w1, w2, out_rows, experts=None):
        """The role's kernel with the adapters of local ``experts`` (None: all) on weights
        w1 [n, 2f/etp, h], w2 [n, h, f/etp]."""
        if self.merged:
            return self.base_compute(x, idx, counts, probs, w1, w2, out_rows, experts)
        role = self.role
        return lora_swiglu_experts(role.resolved_kernel(), x, idx, counts, probs, w1, w2,
                                   self.factors().select(experts), out_rows, role.glu)

    def merge(self) -> None:
        if record(self.role.gate_up_weight).stored:  # the store's files are never written to
            raise ConfigError("lora: adapters cannot be merged into tiered experts (model.moe.expert_store); "
                              "merge on a model with resident experts")
        super().merge()

    def deltas(self):
        f = self.factors()
        return [(self.role.gate_up_weight, torch.matmul(f.b1.float(), f.a1.float()) * f.scale),
                (self.role.down_weight, torch.matmul(f.b2.float(), f.a2.float()) * f.scale)]


# ---- attaching ---------------------------------------------------------------------------

def _attach_linear(m: nn.Module, cfg: LoRAConfig, groups: ParallelGroups) -> None:
    rules = sharding(m.weight)
    out_local, in_local = m.weight.shape
    like = getattr(m, "weight_like", None)  # a frozen FP8 weight computes in another dtype
    w = like() if like is not None else m.weight
    m.lora_A, m.lora_B = _param(w, cfg.rank, in_local), _param(w, out_local, cfg.rank)
    if any(r.dim == 0 for r in rules):  # column-parallel: B split like W's rows, A's gradient partial
        set_sharding(m.lora_B, *rules)
        for r in rules:
            mark_partial_grad(m.lora_A, r.group)
    elif rules:  # row-parallel: A split like W's columns, B's gradient partial
        set_sharding(m.lora_A, *rules)
        for r in rules:
            mark_partial_grad(m.lora_B, r.group)
    mark_init(m.lora_A, kaiming_uniform_init(full_shape(m.weight, groups)[1]))
    mark_init(m.lora_B, const_init(0.0))


def _attach_experts(m: nn.Module, cfg: LoRAConfig, groups: ParallelGroups) -> None:
    e, _, h = m.gate_up_weight.shape
    f_local = m.down_weight.size(2)
    # adapters live where the weights compute (a tiered role's weights are meta placeholders)
    like = getattr(m, "weight_like", None)
    f, r, w = f_local * groups.size("etp"), cfg.rank, like() if like is not None else m.gate_up_weight
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
    fraction = record(m.gate_up_weight).active_fraction
    for name, (p, rules, fan_in) in params.items():
        set_sharding(p, *rules)
        mark_init(p, kaiming_uniform_init(fan_in) if fan_in else const_init(0.0))
        if rules:  # per-expert: sharded over ep (and etp), hence an expert parameter
            mark_active_fraction(p, fraction)
        else:  # used by the experts of every rank: the stage's ranks each hold a partial gradient
            mark_partial_grad(p, "tp")
        m.register_parameter(name, p)


def attach(module: nn.Module, cfg: LoRAConfig, groups: ParallelGroups) -> Adapter:
    """Wrap ``module`` (a linear or routed-experts role of any backend) in its adapter, in place:
    the factors become its parameters, and the adapter's entry points replace the role's on
    this instance (the class, the base parameters and their names stay)."""
    if role_kind(module) == "experts":
        _attach_experts(module, cfg, groups)
        adapter = ExpertAdapter(module, cfg, groups)
        module.compute = adapter.compute
    else:
        _attach_linear(module, cfg, groups)
        adapter = LinearAdapter(module, cfg)
        module.local_linear, module.effective_weight = adapter.local_linear, adapter.effective_weight
    module.lora_adapter = adapter
    return adapter
