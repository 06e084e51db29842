"""Dense SwiGLU MLP (layout letter ``d``): down(act(gate(x), up(x))), and the gated unit every
SwiGLU here computes (dense and shared MLPs, each expert kernel).

The unit is ``GLU`` (``glu_act``)::

    gate <- min(gate, limit),  up <- clamp(up, -limit, limit)        (when limit is set)
    act   = gate * sigmoid(alpha * gate) * (up + up_shift)

plain SwiGLU ``silu(gate) * up`` is ``GLU()``; GLM-5-Next clamps (``GLU(limit)``); SwiGLU-OAI
(MiniMax-M3, gpt-oss with gate and up not interleaved) is ``GLU(limit, alpha=1.702, up_shift=1)``.
The config fields are ``swiglu_limit`` and ``swiglu_alpha`` (alpha set: SwiGLU-OAI).

Parameters: 3 * hidden * ffn (+ biases). gate|up is one column-parallel linear with two
fused parts, so each TP rank holds its slice of both.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megamoe.core.config import MLPConfig
from megamoe.layers.spec import BuildContext, ModuleSpec, register_mlp


class GLU(NamedTuple):
    """The gated unit's constants (module docstring): plain SwiGLU by default."""

    limit: float | None = None
    alpha: float = 1.0
    up_shift: float = 0.0


SWIGLU = GLU()


def glu_of(cfg) -> GLU:
    """The unit an MLP or MoE section configures (``swiglu_limit``, ``swiglu_alpha``)."""
    alpha = cfg.swiglu_alpha
    return GLU(cfg.swiglu_limit, 1.0, 0.0) if alpha is None else GLU(cfg.swiglu_limit, float(alpha), 1.0)


def clamp_gate_up(gate: torch.Tensor, up: torch.Tensor, limit: float | None):
    """The bounded inputs: gate <= limit, |up| <= limit (no clamp when limit is None)."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(-limit, limit)


def glu_gate(gate: torch.Tensor, glu: GLU) -> torch.Tensor:
    """gate * sigmoid(alpha * gate) (silu for alpha 1)."""
    return F.silu(gate) if glu.alpha == 1.0 else gate * torch.sigmoid(glu.alpha * gate)


def glu_gate_grad(gate: torch.Tensor, glu: GLU) -> torch.Tensor:
    """d glu_gate / d gate = s (1 + alpha gate (1 - s)), s = sigmoid(alpha gate)."""
    sig = torch.sigmoid(glu.alpha * gate)
    return sig * (1 + glu.alpha * gate * (1 - sig))


def shifted(up: torch.Tensor, glu: GLU) -> torch.Tensor:
    return up + glu.up_shift if glu.up_shift else up


def glu_act(gate_up: torch.Tensor, glu: GLU = SWIGLU) -> torch.Tensor:
    """[..., 2f] (gate | up) -> [..., f] (module docstring)."""
    gate, up = clamp_gate_up(*gate_up.chunk(2, dim=-1), glu.limit)
    return glu_gate(gate, glu) * shifted(up, glu)


class SwiGLUMLP(nn.Module):
    """x: [b, s, h] (``[b, s/tp, h]`` under SP) -> same shape."""

    def __init__(self, cfg: MLPConfig, ctx: BuildContext, layer_number: int = 0, *,
                 ffn_hidden_size: int | None = None):
        super().__init__()
        h, f = ctx.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        self.linear_fc1 = ctx.backend.column_linear(ctx, h, [f, f], bias=cfg.bias)
        self.linear_fc2 = ctx.backend.row_linear(ctx, f, h, bias=cfg.bias)
        self.glu = glu_of(cfg)

    def forward(self, x: torch.Tensor, info=None) -> torch.Tensor:
        return self.linear_fc2(glu_act(self.linear_fc1(x), self.glu))


register_mlp("d", ModuleSpec(SwiGLUMLP))
