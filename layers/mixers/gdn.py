"""Gated DeltaNet mixer (layout letter ``G``): Qwen3-Next and Qwen3.5 linear attention.

    x --in_proj--> q, k, v, z, b, a                      (one column-parallel GEMM, parts by head)
    q|k|v --causal depthwise conv (kernel K) + SiLU--> q, k, v;   q, k L2-normalised per head
    beta = sigmoid(b);   g = -exp(A_log) * softplus(a + dt_bias)   (one decay per value head)
    o = gated delta rule(q, k, v, g, beta)                (see delta_rule.py; chunked in training)
    out_proj( RMSNorm(o) * silu(z) )                      (norm over value_head_dim, per head)

Shapes: x [b, s, hidden] (``[b, s/tp, hidden]`` under SP); q, k [b, s, hk, dk]; v, z, o
[b, s, hv, dv]; hk, hv are this TP rank's heads. Decode state in ``cache.layer(n)``:
``conv`` [b, K-1, 2*hk*dk + hv*dv] and ``recurrent`` [b, hv, dk, dv] (fp32). Context parallelism
and packed documents: ``context_parallel.py`` (state passing, conv halo, state resets).

Parameters per layer: hidden * (2*Hk*dk + 2*Hv*dv + 2*Hv)   (in_proj)
                      + (2*Hk*dk + Hv*dv) * K              (conv)
                      + 2*Hv + dv                           (A_log, dt_bias, norm)
                      + Hv*dv * hidden                      (out_proj)
HF layouts (fused ``in_proj_qkvz``/``in_proj_ba`` or separate) map onto ``in_proj`` with the
transforms in ``megamoe/convert/hf_layout.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.layers.cache.decode import zero_pads
from megamoe.core.config import GDNConfig
from megamoe.parallel.sharding import const_init
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mixer
from megamoe.layers.mixers.linear_common import (conv_and_state, conv_param, head_param, log_uniform_init,
                                              run_delta_rule)
from megamoe.layers.ops.sequence_view import SequenceView


@dataclass(frozen=True)
class GDNShapes:
    """Head counts and sizes of the GDN ``in_proj`` / ``conv_weight`` parts (rows per part)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int

    @classmethod
    def from_config(cls, cfg) -> "GDNShapes":
        return cls(cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim)

    @property
    def ratio(self) -> int:
        return self.value_heads // self.key_heads

    def in_proj_parts(self) -> tuple[int, ...]:
        """Row counts of q, k, v, z, b, a in ``in_proj``."""
        kd, vd = self.key_heads * self.key_head_dim, self.value_heads * self.value_head_dim
        return (kd, kd, vd, vd, self.value_heads, self.value_heads)

    def conv_parts(self) -> tuple[int, ...]:
        return self.in_proj_parts()[:3]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: GDNConfig, ctx: BuildContext, layer_number: int = 0):
        super().__init__()
        self.layer_number, self.cfg = layer_number, cfg
        self.recompute_core = False  # train.recompute=[core]: the chunk op recomputes in backward
        tp = ctx.groups.tp_size
        shapes = GDNShapes.from_config(cfg)
        self.hk, self.hv = cfg.num_key_heads // tp, cfg.num_value_heads // tp
        self.dk, self.dv = cfg.key_head_dim, cfg.value_head_dim
        self.local_parts = [p // tp for p in shapes.in_proj_parts()]
        b = ctx.backend
        self.conv, self.l2norm, self.op = b.short_conv(ctx), b.l2_norm(ctx), b.delta_rule(ctx)  # kernel roles
        self.in_proj = b.column_linear(ctx, ctx.hidden_size, list(shapes.in_proj_parts()))
        self.conv_weight = conv_param(ctx, shapes.conv_parts(), cfg.conv_kernel)
        self.A_log = head_param(ctx, cfg.num_value_heads, log_uniform_init(1.0, 16.0))
        self.dt_bias = head_param(ctx, cfg.num_value_heads, const_init(1.0))
        eps = ctx.norm_eps if cfg.norm_eps is None else cfg.norm_eps
        self.norm = b.norm(ctx, self.dv, head_sharded=True, eps=eps, zero_centered=cfg.norm_zero_centered)
        self.out_proj = b.row_linear(ctx, cfg.num_value_heads * self.dv, ctx.hidden_size)

    def decay_and_beta(self, b_in: torch.Tensor, a: torch.Tensor):
        """[b, s, hv] each -> g (log decay, fp32, <= 0), beta in (0, 1)."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, torch.sigmoid(b_in)

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        # padded slots (left-padded batches): zero inputs, so zero keys leave the state zero and the
        # decays there do not depend on what the padding computed
        proj = zero_pads(self.in_proj(x), info.cache)          # [b, s, sum(local parts)]
        bsz, s = proj.shape[:2]
        view = SequenceView.of(info, "G", s, self.layer_number)  # CP, packed documents; None: plain
        qkv_width = sum(self.local_parts[:3])
        qkv, z, b_in, a = proj.split([qkv_width, *self.local_parts[3:]], dim=-1)
        if view is None:
            qkv, state, h0 = conv_and_state(self, qkv, info)
        else:
            qkv, state = view.conv(self.conv, qkv, self.conv_weight), None
        q, k, v = qkv.split(self.local_parts[:3], dim=-1)
        # q carries the dk^-0.5 softmax-free scale; both stored heads-first for the chunked op
        q = self.l2norm(q.reshape(bsz, s, self.hk, self.dk), scale=self.dk ** -0.5, heads_first=True)
        k = self.l2norm(k.reshape(bsz, s, self.hk, self.dk), heads_first=True)
        v = v.reshape(bsz, s, self.hv, self.dv)
        g, beta = self.decay_and_beta(b_in, a)
        if view is not None:
            o = view.delta_rule(self.op, q, k, v, g, beta, scale=1.0, chunk_size=self.cfg.resolved_chunk_size(),
                                recompute=self.recompute_core)
        else:
            o, final = run_delta_rule(self.op, q, k, v, g, beta, scale=1.0, initial_state=h0,
                                      decode=state is not None and s == 1,
                                      chunk_size=self.cfg.resolved_chunk_size(), recompute=self.recompute_core)
        if state is not None:
            state["recurrent"] = final
        o = self.norm(o, gate=z.reshape(bsz, s, self.hv, self.dv))
        return self.out_proj(o.reshape(bsz, s, -1))


register_mixer("G", ModuleSpec(GatedDeltaNet))
