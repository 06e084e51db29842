"""Dense SwiGLU MLP (layout letter ``d``): down(silu(gate(x)) * up(x)), gate and up optionally
clamped (``swiglu_limit``, GLM-5).

Parameters: 3 * hidden * ffn (+ biases). gate|up is one column-parallel linear with two
fused parts, so each TP rank holds its slice of both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import MLPConfig
from megamoe.spec import BuildContext, ModuleSpec, register_mlp


def clamp_gate_up(gate: torch.Tensor, up: torch.Tensor, limit: float | None):
    """GLM-5's bounded SwiGLU inputs: gate <= limit, |up| <= limit (no clamp when limit is None)."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(-limit, limit)


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[..., 2f] (gate | up) -> [..., f]; ``limit``: see ``clamp_gate_up``."""
    gate, up = clamp_gate_up(*gate_up.chunk(2, dim=-1), limit)
    return F.silu(gate) * up


class SwiGLUMLP(nn.Module):
    """x: [b, s, h] (``[b, s/tp, h]`` under SP) -> same shape."""

    def __init__(self, cfg: MLPConfig, ctx: BuildContext, layer_number: int = 0, *,
                 ffn_hidden_size: int | None = None):
        super().__init__()
        h, f = ctx.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        self.linear_fc1 = ctx.backend.column_linear(ctx, h, [f, f], bias=cfg.bias)
        self.linear_fc2 = ctx.backend.row_linear(ctx, f, h, bias=cfg.bias)
        self.swiglu_limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor, info=None) -> torch.Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x), self.swiglu_limit))


register_mlp("d", ModuleSpec(SwiGLUMLP))
