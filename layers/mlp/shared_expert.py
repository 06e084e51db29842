"""The MoE layer's always-on shared expert: a SwiGLU MLP whose output joins the routed one.

``add_to(out, x, gate_w)`` = ``out + [sigmoid(x gate_w^T)] * mlp(x)`` for out, x [b, s, h];
``gate_w`` [1, h] or None. The parameters are the MLP's (``linear_fc1``, ``linear_fc2``); the
gate weight stays on the MoE layer (its checkpoint name is ``shared_gate``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.layers.mlp.dense import SwiGLUMLP


class SharedExpert(SwiGLUMLP):
    """The modules' form: the MLP, the gate, one add (the local backend's; the CPU backend's
    ``FusedSharedExpert`` runs it as one op)."""

    def add_to(self, out: torch.Tensor, x: torch.Tensor, gate_w: torch.Tensor | None) -> torch.Tensor:
        shared = self(x)
        if gate_w is not None:
            shared = shared * torch.sigmoid(F.linear(x, gate_w))
        return out + shared
