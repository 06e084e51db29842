"""RMSNorm, plain (``w * x̂``) or zero-centred (``(1 + w) * x̂``, weight stored around 0)."""
from __future__ import annotations

import torch
from torch import nn

from megamoe.parallel import comm
from megamoe.parallel.groups import group_size
from megamoe.parallel.sharding import Shard, const_init, mark_init, mark_tp_partial_grad, set_sharding


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in fp32, returned in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; statistics in fp32 whatever the input dtype.

    ``tp_partial_grad``: the weight is replicated over TP but sees only part of the work
    (a sequence shard under SP, or one rank's heads), so ``finalize_grads`` sums its
    gradient over TP.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False, *,
                 tp_partial_grad: bool = False, dtype=None, device=None):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        mark_init(self.weight, const_init(0.0 if zero_centered else 1.0))
        if tp_partial_grad:
            mark_tp_partial_grad(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        if self.zero_centered:
            w = w + 1.0
        return (rms_normalize(x, self.eps) * w).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, zero_centered={self.zero_centered}"


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a last dim that is split over ``group`` (a norm over all heads when TP
    holds some of them, e.g. MiniMax lightning attention's output norm).

    x: [..., full_dim / tp] -> same. The sum of squares is all-reduced in the forward and its
    gradient in the backward (each rank normalises its own channels by the shared statistic).
    The weight is split like x.
    """

    def __init__(self, full_dim: int, group=None, eps: float = 1e-6, *, dtype=None, device=None):
        super().__init__()
        self.group, self.full_dim, self.eps = group, full_dim, eps
        self.weight = nn.Parameter(torch.empty(full_dim // group_size(group), dtype=dtype, device=device))
        set_sharding(self.weight, Shard(0, "tp"))
        mark_init(self.weight, const_init(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sumsq = xf.pow(2).sum(-1, keepdim=True)
        # all-reduce forward and backward: copy_to (backward all-reduce) then reduce_from
        sumsq = comm.reduce_from(comm.copy_to(sumsq, self.group), self.group)
        out = xf * torch.rsqrt(sumsq / self.full_dim + self.eps) * self.weight.float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.full_dim} (local {self.weight.numel()}), eps={self.eps}"
