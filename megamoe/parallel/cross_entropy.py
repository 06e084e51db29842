"""Cross-entropy over vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. The softmax
normaliser and the target logit are reduced over the group; the backward pass is the local
slice of ``softmax - onehot``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megamoe.parallel.comm import all_reduce_tensor
from megamoe.parallel.groups import group_rank, group_size

IGNORE_INDEX = -100


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    return all_reduce_tensor(x, group, op)  # timed on sampled steps


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_size):
        # logits: [..., V/tp] (any dtype), labels: [...] global ids; returns [...] loss in at least fp32
        per_rank = logits.size(-1)
        start = group_rank(group) * per_rank
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if start + per_rank > vocab_size:  # padded vocabulary entries never win
            x = x.clone()
            x[..., max(vocab_size - start, 0):] = float("-inf")
        m = x.max(dim=-1).values
        _all_reduce(m, group, dist.ReduceOp.MAX)
        x = x - m.unsqueeze(-1)
        local = labels - start
        valid = labels != IGNORE_INDEX
        inside = (local >= 0) & (local < per_rank) & valid
        idx = local.clamp(0, per_rank - 1).unsqueeze(-1)
        target = x.gather(-1, idx).squeeze(-1).masked_fill(~inside, 0.0)
        _all_reduce(target, group)
        exp = x.exp()
        total = exp.sum(dim=-1)
        _all_reduce(total, group)
        loss = (total.log() - target).masked_fill(~valid, 0.0)
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, inside, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, inside, valid = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, idx, -inside.to(g.dtype).unsqueeze(-1))
        g.mul_((grad * valid).unsqueeze(-1))
        return g.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group=None,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss ``[...]`` (at least fp32, 0 where ``labels == -100``).

    logits: ``[..., V_pad/tp]`` on each rank of ``group``; labels: ``[...]`` global token ids.
    ``vocab_size``: the true vocabulary size; entries past it (TP padding) are excluded.
    """
    full = logits.size(-1) * group_size(group)
    return _VocabParallelCE.apply(logits, labels, group, vocab_size or full)
