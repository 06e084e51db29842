"""Lightning attention (MiniMax-01, layout letter ``L``): linear attention with a fixed decay.

Per head, with slope ``s > 0`` and state ``S`` [dk, dv]::

    S_t = exp(-s) S_{t-1} + k_t^T v_t        o_t = q_t S_t

no softmax scale and no normalisation inside the recurrence. The mixer (as HF
``MiniMaxLightningAttention``)::

    q | k | v = silu(x W_qkv)                      per head [q | k | v]
    o = W_out( sigmoid(x W_gate) * RMSNorm_{heads*dim}(attention) )

Slopes depend on the head and the layer: ``s_h = 2^(-8 (h+1) / H) * (1 - l / (L - 1 + 1e-5) + 1e-5)``
for head h of H, layer l of L. TP splits heads; the output norm spans all heads, so its
statistic is all-reduced over TP.

The operator's three forms (naive, recurrent, chunked) are ``megamoe.layers.ops.lightning``;
the backend's ``lightning`` role picks one.

Parameters per layer: 5 * hidden * heads * head_dim + heads * head_dim (norm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.layers.cache.decode import InferenceCache, zero_pads
from megamoe.core.config import LightningConfig
from megamoe.layers.spec import BuildContext, ForwardInfo, ModuleSpec, register_mixer
from megamoe.layers.ops.sequence_view import SequenceView


def lightning_slopes(num_heads: int, layer_number: int, num_layers: int) -> list[float]:
    """Decay rate of every head (all heads, before the TP split), as MiniMax computes them."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_number / (num_layers - 1 + 1e-5) + 1e-5
    return [base ** (h + 1) * factor for h in range(num_heads)]


class LightningAttention(nn.Module):
    """x: [b, s, h] (``[b, s/tp, h]`` under SP) -> same. Inside: [b, s, heads, head_dim]."""

    def __init__(self, cfg: LightningConfig, ctx: BuildContext, layer_number: int = 0):
        super().__init__()
        self.layer_number, self.block = layer_number, cfg.block_size
        tp, rank = ctx.groups.tp_size, ctx.groups.tp_rank
        self.heads, self.head_dim = cfg.num_heads // tp, cfg.dim(ctx.hidden_size)
        width = cfg.num_heads * self.head_dim
        all_slopes = lightning_slopes(cfg.num_heads, layer_number, ctx.num_layers)
        self.slopes = all_slopes[rank * self.heads:(rank + 1) * self.heads]  # floats: no buffer to restore
        b = ctx.backend
        self.linear_qkv = b.column_linear(ctx, ctx.hidden_size, 3 * width)  # per head [q | k | v]
        self.linear_gate = b.column_linear(ctx, ctx.hidden_size, width)
        self.norm = b.sharded_norm(ctx, width, eps=cfg.norm_eps)
        self.linear_proj = b.row_linear(ctx, width, ctx.hidden_size)
        self.op = b.lightning(ctx)  # .chunked / .recurrent

    def forward(self, x: torch.Tensor, info: ForwardInfo) -> torch.Tensor:
        qkv = F.silu(self.linear_qkv(x))
        bsz, s = qkv.shape[:2]
        q, k, v = qkv.view(bsz, s, self.heads, 3 * self.head_dim).chunk(3, dim=-1)
        slope = torch.tensor(self.slopes, dtype=torch.float64, device=x.device)
        view = SequenceView.of(info, "L", s, self.layer_number)  # CP, packed documents; None: plain
        if view is not None:
            o = view.lightning(self.op, q, k, v, slope, block=self.block)
        else:
            o = self.attend(q, k, v, slope, info.cache)
        o = self.norm(o.reshape(bsz, s, -1)) * torch.sigmoid(self.linear_gate(x))
        return self.linear_proj(o)

    def attend(self, q, k, v, slope, cache: InferenceCache | None):
        if cache is None:
            return self.op.chunked(q, k, v, slope, block=self.block)[0]
        state = cache.layer(self.layer_number)
        k, v = zero_pads(k, cache), zero_pads(v, cache)  # padded slots leave the state as it was (zero)
        if q.size(1) == 1 and "lightning_state" in state:
            o, state["lightning_state"] = self.op.recurrent(q, k, v, slope, state["lightning_state"])
        else:
            o, state["lightning_state"] = self.op.chunked(q, k, v, slope, state.get("lightning_state"),
                                                          block=self.block)
        return o


register_mixer("L", ModuleSpec(LightningAttention))
