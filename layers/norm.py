"""RMSNorm, plain (``w * x̂``) or zero-centred (``(1 + w) * x̂``, weight stored around 0)."""
from __future__ import annotations

import torch
from torch import nn

from megamoe.parallel.sharding import const_init, mark_init, mark_tp_partial_grad


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
