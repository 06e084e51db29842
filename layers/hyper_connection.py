"""Manifold-constrained hyper-connections (mHC; GLM-5), ``model.hyper_connections``.

The residual stream is n streams x [b, s, n, h] (``[b, s/tp, n, h]`` under sequence
parallelism). Around a block f (the mixer, then the MLP), per token::

    z = rms(x flattened to n*h)                          unweighted RMS norm, fp32
    p | q | c = z W^T                                     W = ``fn`` [(2+n)*n, n*h]
    pre  = sigmoid(p * scale[0] + base_pre) + eps                        [b, s, n]
    post = 2 * sigmoid(q * scale[1] + base_post)                         [b, s, n]
    comb = sinkhorn(softmax(c * scale[2] + base_comb, over j) + eps)     [b, s, n(i), n(j)]
    y    = f(sum_i pre_i x_i)                                            [b, s, h]
    x'_j = post_j * y + sum_i comb_ij x_i

``sinkhorn`` alternately divides columns and rows by their sums (columns first, as GLM-5 and
DeepSeek-V4), so ``comb`` is close to doubly stochastic and the streams' mix keeps their scale.
The model copies the embedding into every stream. The final norm reads the streams' mean
(GLM-5) or, with ``head: learned`` (DeepSeek-V4's ``hc_head``, ``HyperHead``), a per-token
weighted sum computed like ``pre``: ``sum_i (sigmoid(rms(x) W_h^T * s_h + b_h) + eps)_i x_i``.

Everything is per token, so sequence parallelism needs nothing but summing the replicated
parameters' gradients over TP (``mark_tp_partial_grad``).

Parameters per block: (2+n)*n*(n*h + 1) + 3; the learned head n*(n*h + 1) + 1.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.core.config import HyperConnectionConfig
from megamoe.layers.norm import rms_normalize
from megamoe.parallel.sharding import const_init, mark_init, mark_tp_partial_grad, normal_init
from megamoe.layers.spec import BuildContext


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] positive -> about doubly stochastic: columns, then ``iters - 1`` x (rows, columns)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def expand_streams(hidden: torch.Tensor, streams: int) -> torch.Tensor:
    """[b, s, h] -> [b, s, n, h]: every stream starts as the embedding."""
    return hidden.unsqueeze(2).expand(-1, -1, streams, -1)


def merge_streams(streams: torch.Tensor) -> torch.Tensor:
    """[b, s, n, h] -> [b, s, h]: the streams' mean (what the final norm reads)."""
    return streams.mean(dim=2)


class HyperConnection(nn.Module):
    """``forward(x, block)``: x [b, s, n, h] -> [b, s, n, h], calling ``block`` on [b, s, h] once."""

    def __init__(self, cfg: HyperConnectionConfig, ctx: BuildContext):
        super().__init__()
        n, h = cfg.streams, ctx.hidden_size
        self.n, self.iters, self.eps = n, cfg.sinkhorn_iters, cfg.eps
        self.norm_eps = ctx.norm_eps if cfg.norm_eps is None else cfg.norm_eps
        kw = dict(dtype=ctx.dtype, device=ctx.device)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * h, **kw))
        self.base = nn.Parameter(torch.empty((2 + n) * n, **kw))
        self.scale = nn.Parameter(torch.empty(3, **kw))
        mark_init(self.fn, normal_init(ctx.init_std))
        mark_init(self.base, const_init(0.0))
        mark_init(self.scale, const_init(1.0))
        if ctx.sp:  # each TP rank sees its sequence shard only
            for p in (self.fn, self.base, self.scale):
                mark_tp_partial_grad(p)

    def weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [b, s, n], post [b, s, n], comb [b, s, n, n]) in fp32."""
        n = self.n
        z = rms_normalize(x.flatten(-2), self.norm_eps) @ self.fn.float().t()
        p, q, c = z.split([n, n, n * n], dim=-1)
        base_p, base_q, base_c = self.base.float().split([n, n, n * n])
        s_p, s_q, s_c = self.scale.float().unbind(0)
        pre = torch.sigmoid(p * s_p + base_p) + self.eps
        post = 2 * torch.sigmoid(q * s_q + base_q)
        comb = torch.softmax((c * s_c + base_c).unflatten(-1, (n, n)), dim=-1) + self.eps
        return pre, post, sinkhorn(comb, self.iters, self.eps)

    def forward(self, x: torch.Tensor, block) -> torch.Tensor:
        pre, post, comb = self.weights(x)
        y = block((pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype))
        mixed = comb.to(x.dtype).transpose(-1, -2) @ x  # [b, s, n, n] @ [b, s, n, h]: sum_i comb_ij x_i
        return post.to(x.dtype).unsqueeze(-1) * y.unsqueeze(-2) + mixed

    def extra_repr(self) -> str:
        return f"streams={self.n}, sinkhorn_iters={self.iters}, eps={self.eps}"


class HyperHead(nn.Module):
    """The streams' learned collapse before the final norm (DeepSeek-V4 ``hc_head``):
    x [b, s, n, h] -> [b, s, h] = sum_i pre_i x_i, pre computed as ``HyperConnection``'s."""

    def __init__(self, cfg: HyperConnectionConfig, ctx: BuildContext):
        super().__init__()
        n, h = cfg.streams, ctx.hidden_size
        self.eps = cfg.eps
        self.norm_eps = ctx.norm_eps if cfg.norm_eps is None else cfg.norm_eps
        kw = dict(dtype=ctx.dtype, device=ctx.device)
        self.fn = nn.Parameter(torch.empty(n, n * h, **kw))
        self.base = nn.Parameter(torch.empty(n, **kw))
        self.scale = nn.Parameter(torch.empty(1, **kw))
        mark_init(self.fn, normal_init(ctx.init_std))
        mark_init(self.base, const_init(0.0))
        mark_init(self.scale, const_init(1.0))
        if ctx.sp:
            for p in (self.fn, self.base, self.scale):
                mark_tp_partial_grad(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = rms_normalize(x.flatten(-2), self.norm_eps) @ self.fn.float().t()
        pre = torch.sigmoid(z * self.scale.float() + self.base.float()) + self.eps  # [b, s, n]
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)
