"""Dense SwiGLU MLP (layout letter ``d``): down(silu(gate(x)) * up(x)).

Parameters: 3 * hidden * ffn (+ biases). gate|up is one column-parallel linear with two
fused parts, so each TP rank holds its slice of both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.config import MLPConfig
from megamoe.spec import BuildContext, ModuleSpec, register_mlp


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2f] (gate | up) -> [..., f]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUMLP(nn.Module):
    """x: [b, s, h] (``[b, s/tp, h]`` under SP) -> same shape."""

    def __init__(self, cfg: MLPConfig, ctx: BuildContext, layer_number: int = 0, *,
                 ffn_hidden_size: int | None = None):
        super().__init__()
        h, f = ctx.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        self.linear_fc1 = ctx.backend.column_linear(ctx, h, [f, f], bias=cfg.bias)
        self.linear_fc2 = ctx.backend.row_linear(ctx, f, h, bias=cfg.bias)

    def forward(self, x: torch.Tensor, info=None) -> torch.Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))


register_mlp("d", ModuleSpec(SwiGLUMLP))
