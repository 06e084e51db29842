"""Kimi delta attention mixer (layout letter ``K``): kimi_linear, glm5_next, bailing_hybrid.

The gated delta rule with one decay per key channel::

    x --in_proj--> q, k, v, b                             (one column-parallel GEMM, parts by head)
    q|k|v --causal depthwise conv (kernel K) + SiLU--> q, k, v;   q, k L2-normalised per head
    f = f_b(f_a(x))  (low rank r)  or  f_proj(x)  (gate_rank 0)                [b, s, h, d]
    g = -exp(A_log) * softplus(f + dt_bias)        or, with gate_lower_bound lb,
    g = lb * sigmoid(exp(A_log) * (f + dt_bias))   (the "safe gate" of glm5_next/bailing_hybrid)
    o = gated delta rule(q, k, v, g, sigmoid(b))
    out_proj( RMSNorm(o) * sigmoid(gate) ),  gate = g_b(g_a(x)) or g_proj(x)

Shapes: x [b, s, hidden] (``[b, s/tp, hidden]`` under SP); q, k, v, o [b, s, h, d] with h this
TP rank's heads. The low-rank down projections (f_a, g_a) are replicated over TP; the rest is
split by head. Decode state in ``cache.layer(n)``: ``conv`` [b, K-1, 3*h*d], ``recurrent``
[b, h, d, d] (fp32). Context parallelism and packed documents: ``context_parallel.py``.

Parameters per layer (H heads of dim d, W = H*d, r = gate rank):
    hidden * (3W + H) + 3W * K                     (in_proj, conv)
  + 2 * (hidden*r + r*W)   or   2 * hidden*W       (forget and output gates; low rank or full)
  + H + W + d + W * hidden                         (A_log, dt_bias, norm, out_proj)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.layers.cache.decode import zero_pads
from megamoe.core.config import KDAConfig
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mixer
from megamoe.layers.ops.sequence_view import SequenceView
from megamoe.layers.mixers.linear_common import (conv_and_state, conv_param, head_param, log_uniform_init,
                                              run_delta_rule)


def dt_bias_init(draw) -> torch.Tensor:
    """softplus^-1 of dt ~ logU(1e-3, 1e-1), as fla and kimi_linear initialise dt_bias."""
    dt = torch.exp(draw.uniform() * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt = dt.clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class Gate(nn.Module):
    """hidden -> heads*head_dim, low rank (replicated down, column-parallel up) or full rank.

    x [b, s, hidden] -> [b, s, h*d] for this rank's heads."""

    def __init__(self, ctx: BuildContext, rank: int, width: int):
        super().__init__()
        b = ctx.backend
        if rank:
            self.down = b.replicated_linear(ctx, ctx.hidden_size, rank)
            self.up = b.column_linear(ctx, rank, width, sequence_parallel=False)
        else:
            self.down = nn.Identity()
            self.up = b.column_linear(ctx, ctx.hidden_size, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: KDAConfig, ctx: BuildContext, layer_number: int = 0):
        super().__init__()
        self.layer_number, self.cfg = layer_number, cfg
        self.recompute_core = False  # train.recompute=[core]: the chunk op recomputes in backward
        tp = ctx.groups.tp_size
        self.h, self.d = cfg.num_heads // tp, cfg.head_dim
        width = cfg.num_heads * cfg.head_dim
        self.local_parts = [width // tp] * 3 + [self.h]
        b = ctx.backend
        self.conv, self.l2norm, self.op = b.short_conv(ctx), b.l2_norm(ctx), b.delta_rule(ctx)  # kernel roles
        self.in_proj = b.column_linear(ctx, ctx.hidden_size, [width, width, width, cfg.num_heads])
        self.conv_weight = conv_param(ctx, (width,) * 3, cfg.conv_kernel)
        self.forget_gate = Gate(ctx, cfg.rank(), width)
        self.output_gate = Gate(ctx, cfg.rank(), width)
        self.A_log = head_param(ctx, cfg.num_heads, log_uniform_init(1.0, 16.0))
        self.dt_bias = head_param(ctx, width, dt_bias_init)
        eps = ctx.norm_eps if cfg.norm_eps is None else cfg.norm_eps
        self.norm = b.norm(ctx, self.d, head_sharded=True, eps=eps, zero_centered=False)
        self.out_proj = b.row_linear(ctx, width, ctx.hidden_size)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, hidden] -> g [b, s, h, d], log decay per key channel in fp32 (<= 0)."""
        f = self.forget_gate(x).float() + self.dt_bias.float()
        f = f.reshape(*f.shape[:2], self.h, self.d)
        rate = self.A_log.float().exp().unsqueeze(-1)              # [h, 1]
        if self.cfg.gate_lower_bound is not None:
            return self.cfg.gate_lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f)

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        proj = zero_pads(self.in_proj(x), info.cache)  # padded slots: zero keys, state unchanged (as GDN)
        bsz, s = proj.shape[:2]
        view = SequenceView.of(info, "K", s, self.layer_number)  # CP, packed documents; None: plain
        qkv, b_in = proj.split([sum(self.local_parts[:3]), self.h], dim=-1)
        if view is None:
            qkv, state, h0 = conv_and_state(self, qkv, info)
        else:
            qkv, state = view.conv(self.conv, qkv, self.conv_weight), None
        q, k, v = (t.reshape(bsz, s, self.h, self.d) for t in qkv.split(self.local_parts[:3], dim=-1))
        g = zero_pads(self.decay(x), info.cache)  # log-decay 0 at padded slots: the state passes unchanged
        if view is not None:
            o = view.delta_rule(self.op, self.l2norm(q), self.l2norm(k), v, g, torch.sigmoid(b_in),
                                chunk_size=self.cfg.chunk_size, recompute=self.recompute_core)
        else:
            o, final = run_delta_rule(self.op, self.l2norm(q), self.l2norm(k), v, g, torch.sigmoid(b_in),
                                      initial_state=h0, decode=state is not None and s == 1,
                                      chunk_size=self.cfg.chunk_size, recompute=self.recompute_core)
        if state is not None:
            state["recurrent"] = final
        gate = self.output_gate(x).reshape(bsz, s, self.h, self.d)
        o = self.norm(o, gate=gate, gate_act="sigmoid")
        return self.out_proj(o.reshape(bsz, s, -1))


register_mixer("K", ModuleSpec(KimiDeltaAttention))
