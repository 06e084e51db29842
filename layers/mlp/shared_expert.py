"""The MoE layer's always-on shared expert: a SwiGLU MLP whose output joins the routed one.

``add_to(out, x, gate_w)`` = ``out + [sigmoid(x gate_w^T)] * mlp(x)`` for out, x [b, s, h]
(``two_parts``: the same in two steps, which the MoE layer overlaps with its all-to-alls);
``gate_w`` [1, h] or None. The parameters are the MLP's (``linear_fc1``, ``linear_fc2``); the
gate weight stays on the MoE layer (its checkpoint name is ``shared_gate``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe.layers.mlp.dense import SwiGLUMLP, glu_act


class SharedExpert(SwiGLUMLP):
    """The modules' form: the MLP, the gate, one add (the local backend's; the CPU backend's
    ``FusedSharedExpert`` runs it as one op)."""

    def add_to(self, out: torch.Tensor, x: torch.Tensor, gate_w: torch.Tensor | None) -> torch.Tensor:
        return out + _gated(self(x), x, gate_w)

    def two_parts(self, x: torch.Tensor, gate_w: torch.Tensor | None):
        """``add_to(0, x, gate_w)`` as two pieces of work, for the MoE layer to run while its
        dispatch and its combine all-to-all are in flight: fc1 and the gated unit, then fc2 and
        the gate; the second returns the output [b, s, h]."""
        hidden: list[torch.Tensor] = []

        def first() -> None:
            hidden.append(glu_act(self.linear_fc1(x), self.glu))

        def second() -> torch.Tensor:
            return _gated(self.linear_fc2(hidden.pop()), x, gate_w)

        return first, second


def _gated(shared: torch.Tensor, x: torch.Tensor, gate_w: torch.Tensor | None) -> torch.Tensor:
    return shared if gate_w is None else shared * torch.sigmoid(F.linear(x, gate_w))
