"""Routed SwiGLU experts with stacked weights, sharded over expert (ep) and expert-tensor (etp)
parallelism. The ``grouped_experts`` role of both backends (their default kernels differ).

Full shapes (what initialisation, checkpoints and conversion see, whatever the layout)::

    gate_up_weight [E, 2f, h]   gate | up, nn.Linear layout (HF's ``experts.gate_up_proj``)
    down_weight    [E, h, f]    (HF's ``experts.down_proj``)

Rank (ep=r, etp=q) holds experts r*E/ep .. (r+1)*E/ep-1 and slice q of f (of both gate and
up), so its down projection yields a partial sum over etp ranks.

Parameters: 3 * E * h * f, of which top_k / E are active per token (``mark_active_fraction``).
Their shard rules over ep/etp make them expert parameters (``megamoe.parallel.record``): their
gradients are reduced over the expert-data-parallel group (``groups.edp``), not the
data-parallel one.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.parallel.record import mark_active_fraction
from megamoe.parallel.sharding import Shard, mark_init, normal_init, set_sharding
from megamoe.layers.spec import BuildContext
from megamoe.layers.mlp.dispatch import local_pairs
from megamoe.layers.ops.grouped_gemm import check_kernel, swiglu_experts
from megamoe.layers.mlp.dense import SWIGLU, GLU


def reference_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The ``local`` backend's ``auto``: the reference loop on any device."""
    return "reference"


class GroupedExperts(nn.Module):
    """``forward(x, idx, counts, probs, out_rows)``: see ``megamoe.layers.ops.grouped_gemm``.

    x: [N, h] rows; idx: [S] row indices grouped by local expert with ``counts`` [E/ep]
    (python ints); probs: [S]; returns [out_rows, h] (a partial sum over etp ranks).
    """

    def __init__(self, ctx: BuildContext, num_experts: int, ffn_hidden_size: int, *, kernel: str = "auto",
                 active_fraction: float = 1.0, glu: GLU = SWIGLU, fusion: Fusion = EAGER,
                 auto_kernel: Callable[[torch.device, torch.dtype], str] = reference_kernel):
        super().__init__()
        self.auto_kernel = auto_kernel  # the building backend's choice for kernel='auto', per device
        self.fusion = fusion  # the building backend's policy for the loop kernel's SwiGLU passes
        ep, etp = ctx.groups.size("ep"), ctx.groups.size("etp")
        h, f = ctx.hidden_size, ffn_hidden_size
        if num_experts % ep or f % etp:
            raise ValueError(f"{num_experts} experts / ffn {f} do not split over ep={ep} / etp={etp}")
        self.num_experts, self.num_local = num_experts, num_experts // ep
        self.hidden_size, self.ffn_hidden_size, self.etp_size = h, f, etp
        self.local_start = ctx.groups.rank("ep") * self.num_local
        self.kernel, self.glu = kernel, glu  # the gated unit (megamoe.layers.mlp.dense.GLU)
        kw = dict(dtype=ctx.dtype, device=ctx.device)
        self.gate_up_weight = nn.Parameter(torch.empty(self.num_local, 2 * f // etp, h, **kw))
        set_sharding(self.gate_up_weight, Shard(0, "ep"), Shard(1, "etp", parts=(f, f)))
        mark_init(self.gate_up_weight, normal_init(ctx.init_std))
        self.down_weight = nn.Parameter(torch.empty(self.num_local, h, f // etp, **kw))
        set_sharding(self.down_weight, Shard(0, "ep"), Shard(2, "etp"))
        mark_init(self.down_weight, normal_init(ctx.init_std / (2.0 * ctx.num_layers) ** 0.5))
        for p in (self.gate_up_weight, self.down_weight):
            mark_active_fraction(p, active_fraction)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, counts: Sequence[int], probs: torch.Tensor | None,
                out_rows: int) -> torch.Tensor:
        return self.compute(x, idx, counts, probs, self.gate_up_weight, self.down_weight, out_rows)

    def compute(self, x, idx, counts: Sequence[int], probs, w1: torch.Tensor, w2: torch.Tensor, out_rows: int,
                experts: Sequence[int] | None = None) -> torch.Tensor:
        """The kernel on given weights: w1 [n, 2f/etp, h], w2 [n, h, f/etp] for the local
        ``experts`` (None: all of them, n = E/ep) with ``counts`` [n]. What subclasses extend
        (adapters) or feed differently (tiered storage)."""
        return swiglu_experts(self.resolved_kernel(), x, idx, counts, probs, w1, w2, out_rows, self.glu,
                              self.fusion.active(x.device))

    def local_dispatch(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                       local_ids: bool = False) -> torch.Tensor | None:
        """The single-rank dropless dispatch and this kernel as one opaque op (``local_experts``)
        for a compiled graph (a whole-step compiled decode step, ``megamoe.inference.generate``), which
        cannot hold the python expert counts the kernels take. None where this role computes
        otherwise (a subclass's or an adapter's ``forward``/``compute``: tiered storage, LoRA),
        its experts are sharded or a gradient is wanted: the caller runs the dispatch outside
        the graph then. ``local_ids``: ``idx`` already names this rank's experts (0..num_local-1:
        rows an expert exchange delivered), so experts over ep are fine."""
        own = (type(self).forward is GroupedExperts.forward and type(self).compute is GroupedExperts.compute
               and "compute" not in self.__dict__ and "forward" not in self.__dict__  # replaced on the instance
               and not self._forward_hooks and not self._forward_pre_hooks)  # the op skips __call__
        if not own or (self.num_local != self.num_experts and not local_ids) or self.etp_size != 1 or (
                torch.is_grad_enabled() and (x.requires_grad or self.gate_up_weight.requires_grad)):
            return None
        return local_experts(x, weights, idx, self.gate_up_weight, self.down_weight, self.resolved_kernel(),
                             *self.glu)

    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's shapes of one expert's two weights: (2f/etp, h), (h, f/etp)."""
        fl = self.ffn_hidden_size // self.etp_size
        return (2 * fl, self.hidden_size), (self.hidden_size, fl)

    def weight_like(self) -> torch.Tensor:
        """A tensor with the weights' dtype and device (what adapters are created like)."""
        return self.gate_up_weight

    def resolved_kernel(self) -> str:
        """The kernel that runs on the weights' device and dtype (``auto``: the backend's choice)."""
        return self.kernel_for(self.gate_up_weight)

    def kernel_for(self, like: torch.Tensor) -> str:
        name = self.auto_kernel(like.device, like.dtype) if self.kernel == "auto" else self.kernel
        return check_kernel(name, like.device, like.dtype)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (local {self.num_local} from {self.local_start}), "
                f"local gate_up={tuple(self.gate_up_weight.shape)}, kernel={self.kernel}")


@torch.library.custom_op("megamoe::local_experts", mutates_args=())
def local_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  kernel: str, limit: float | None, alpha: float, up_shift: float) -> torch.Tensor:
    """``dispatch_local`` with every pair kept (``megamoe.layers.mlp.dispatch``) on weights w1, w2:
    x [T, h], weights/idx [T, k] -> [T, h]. Eager inside (one graph node), unfused."""
    token, counts, probs = local_pairs(weights, idx, None, w1.size(0))
    return swiglu_experts(kernel, x, token, counts, probs, w1, w2, x.size(0), GLU(limit, alpha, up_shift), False)


@local_experts.register_fake
def _(x, weights, idx, w1, w2, kernel, limit, alpha, up_shift):
    return x.new_empty(x.shape)  # contiguous [T, h], as every kernel returns
