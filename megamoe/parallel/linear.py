"""Tensor-parallel linears and the vocab-parallel embedding, device-agnostic torch.

Activations are batch-first ``[b, s, h]``; under sequence parallelism each TP rank holds
``[b, s/tp, h]`` and the sequence dim (1) is gathered before a column-parallel linear and
reduce-scattered after a row-parallel one.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.parallel import comm
from megamoe.parallel.groups import group_rank, group_size
from megamoe.parallel.sharding import (Shard, const_init, mark_init, mark_tp_partial_grad,
                                       normal_init, set_sharding)

SEQ_DIM = 1  # [b, s, h]


def _parts(out_features: int | Sequence[int]) -> tuple[int, ...]:
    return (out_features,) if isinstance(out_features, int) else tuple(out_features)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows over ``group``.

    ``out_features`` may be a list of fused parts (e.g. ``[ffn, ffn]`` for gate|up); each part
    is split separately, so rank r holds ``[gate_r; up_r]`` and can chunk its output.

    x: [b, s, in] (``[b, s/tp, in]`` with sequence_parallel) -> y: [b, s, out/tp]
    (``[b, s, out]`` with gather_output).
    """

    local_bias = True  # local_linear adds the bias (a row-parallel one adds it after the reduction)

    def __init__(self, in_features: int, out_features: int | Sequence[int], group=None, *,
                 bias: bool = False, gather_output: bool = False, sequence_parallel: bool = False,
                 init_std: float = 0.02, dtype=None, device=None, group_name: str = "tp"):
        super().__init__()
        self.group, self.parts = group, _parts(out_features)
        size = group_size(group)
        for p in self.parts:
            if p % size:
                raise ValueError(f"output size {p} is not divisible by {group_name} size {size}")
        if gather_output and len(self.parts) > 1:
            raise ValueError("gather_output needs a single output part")
        self.in_features, self.out_features = in_features, sum(self.parts)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and size > 1
        local_out = self.out_features // size
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype, device=device))
        set_sharding(self.weight, Shard(0, group_name, self.parts if len(self.parts) > 1 else None))
        mark_init(self.weight, normal_init(init_std))
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype, device=device))
            set_sharding(self.bias, Shard(0, group_name, self.parts if len(self.parts) > 1 else None))
            mark_init(self.bias, const_init(0.0))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = comm.gather_reduce_scatter(x, SEQ_DIM, self.group)
        else:
            x = comm.copy_to(x, self.group)
        y = self.local_linear(x)
        return comm.gather_from(y, -1, self.group) if self.gather_output else y

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product [b, s, in] -> [b, s, out/tp] (what adapters extend, megamoe.lora)."""
        return F.linear(x, self.weight, self.bias)

    def effective_weight(self) -> torch.Tensor:
        """The local weight this linear applies (with any adapter folded in)."""
        return self.weight

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, parts={self.parts}, sp={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are reduced over ``group``.

    x: [b, s, in/tp] -> y: [b, s, out] (``[b, s/tp, out]`` with sequence_parallel).
    """

    local_bias = False  # local_linear adds the bias (a row-parallel one adds it after the reduction)

    def __init__(self, in_features: int | Sequence[int], out_features: int, group=None, *,
                 bias: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 dtype=None, device=None, group_name: str = "tp"):
        super().__init__()
        self.group, self.parts = group, _parts(in_features)
        size = group_size(group)
        for p in self.parts:
            if p % size:
                raise ValueError(f"input size {p} is not divisible by {group_name} size {size}")
        self.in_features, self.out_features = sum(self.parts), out_features
        self.sequence_parallel = sequence_parallel and size > 1
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features // size, dtype=dtype,
                                               device=device))
        set_sharding(self.weight, Shard(1, group_name, self.parts if len(self.parts) > 1 else None))
        mark_init(self.weight, normal_init(init_std))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
            mark_init(self.bias, const_init(0.0))
            if self.sequence_parallel:
                mark_tp_partial_grad(self.bias)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_linear(x)
        if self.sequence_parallel:
            y = comm.reduce_scatter_to(y, SEQ_DIM, self.group)
        else:
            y = comm.reduce_from(y, self.group)
        return y if self.bias is None else y + self.bias

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [b, s, in/tp] -> [b, s, out], before the reduction over TP."""
        return F.linear(x, self.weight)

    def effective_weight(self) -> torch.Tensor:
        return self.weight

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over ``group``; the vocab is zero-padded to a multiple of its size.

    ids: [b, s] -> [b, s, h] (``[b, s/tp, h]`` with sequence_parallel).
    """

    def __init__(self, vocab_size: int, hidden_size: int, group=None, *, sequence_parallel: bool = False,
                 init_std: float = 0.02, dtype=None, device=None):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        size = group_size(group)
        self.padded_vocab = -(-vocab_size // size) * size
        self.per_rank = self.padded_vocab // size
        self.start = group_rank(group) * self.per_rank
        self.sequence_parallel = sequence_parallel and size > 1
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=dtype, device=device))
        set_sharding(self.weight, Shard(0, "tp", unpadded=vocab_size))
        mark_init(self.weight, normal_init(init_std))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to(out, SEQ_DIM, self.group)
        return comm.reduce_from(out, self.group)


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b) with W the same on every TP rank (MLA's down-projections, indexers).

    Contract: y's gradient is identical on every TP rank (y feeds column-parallel linears,
    which all-reduce their input gradient, or the caller makes it so with ``comm.copy_to``).
    So W's gradient is already complete and x needs no gradient reduction: without sequence
    parallelism the input passes through; with it the sequence is all-gathered and the
    backward keeps this rank's chunk.

    x: [b, s, in] (``[b, s/tp, in]`` with sequence_parallel) -> y: [b, s, out].
    """

    local_bias = True  # local_linear adds the bias (a row-parallel one adds it after the reduction)

    def __init__(self, in_features: int, out_features: int, group=None, *, bias: bool = False,
                 sequence_parallel: bool = False, init_std: float = 0.02, dtype=None, device=None):
        super().__init__()
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        mark_init(self.weight, normal_init(init_std))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
            mark_init(self.bias, const_init(0.0))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = comm.gather_from(x, SEQ_DIM, self.group)
        return self.local_linear(x)

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def effective_weight(self) -> torch.Tensor:
        return self.weight

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, sp={self.sequence_parallel}"
