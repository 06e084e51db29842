"""``local``: the pure-torch reference of every role, on any device.

Plain autograd ops only: the RMSNorm and L2 norm formulas, torch's conv1d for the short
convolution, the token-by-token recurrences for the linear-attention ops (their chunked
role too), the per-expert reference loop for the routed experts, and the shared expert as
modules. Slow where the CPU backend is fast; it is what the contract tests compare against.
"""
from __future__ import annotations

from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.layers.spec import BuildContext
from megamoe.layers.backends.base import BaseBackend
from megamoe.layers.ops.lightning import lightning_recurrent
from megamoe.layers.ops.conv import causal_conv_reference
from megamoe.layers.ops.l2norm import l2norm_reference
from megamoe.layers.ops.delta_rule.naive import recurrent_delta_rule
from megamoe.layers.ops.delta_rule.passing import widened_passing
from megamoe.layers.norm import RMSNorm, rms_norm_reference
from megamoe.layers.mlp.dense import SWIGLU, GLU
from megamoe.layers.mlp.shared_expert import SharedExpert


class RecurrentDeltaRule:
    """The gated delta rule (GDN: g [b, t, hv]; KDA: g [b, t, h, dk]) as its recurrence, for
    whole sequences and decode steps alike (shapes: ``megamoe.layers.ops.delta_rule.naive``)."""

    def chunked(self, q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                recompute: bool = False):
        return recurrent_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def recurrent(self, q, k, v, g, beta, *, scale=None, initial_state=None):
        return recurrent_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def passing(self, q, k, v, g, beta, link, *, scale=None, chunk_size: int = 64, recompute: bool = False):
        """Under CP: the recurrence run widened (``megamoe.layers.ops.delta_rule.passing``)."""
        return widened_passing(self.chunked, q, k, v, g, beta, link, scale=scale, chunk_size=chunk_size,
                               recompute=recompute)


class RecurrentLightning:
    """Lightning attention as its token-by-token recurrence (``megamoe.layers.mixers.lightning``)."""

    def chunked(self, q, k, v, slope, initial_state=None, block: int = 64, resets=None):
        return lightning_recurrent(q, k, v, slope, initial_state, resets=resets)

    def recurrent(self, q, k, v, slope, initial_state=None):
        return lightning_recurrent(q, k, v, slope, initial_state)


class LocalBackend(BaseBackend):
    name = "local"

    def __init__(self, fusion: Fusion = EAGER):
        super().__init__(EAGER)  # the reference never compiles anything, whatever model.fusion says

    def norm(self, ctx: BuildContext, dim: int, *, sequence_parallel: bool = False, head_sharded: bool = False,
             eps: float | None = None, zero_centered: bool | None = None):
        """RMSNorm (plain, zero-centred; gated through ``forward(x, gate=...)``). ``sequence_parallel``:
        applied to the residual stream (a sequence shard under SP); ``head_sharded``: applied to
        this TP rank's heads only (QK-norm)."""
        return _norm(ctx, dim, sequence_parallel, head_sharded, eps, zero_centered, rms_norm_reference)

    def l2_norm(self, ctx: BuildContext):
        """(x, eps, scale, heads_first) -> scale x / |x| in fp32 (``l2norm``'s contract)."""
        return l2norm_reference

    def short_conv(self, ctx: BuildContext):
        """(x [b, t, c], weight [c, K], state [b, K-1, c] | None) -> (silu(causal conv), new state)."""
        return causal_conv_reference

    def delta_rule(self, ctx: BuildContext):
        return RecurrentDeltaRule()

    def lightning(self, ctx: BuildContext):
        return RecurrentLightning()

    def grouped_experts(self, ctx: BuildContext, num_experts: int, ffn_hidden_size: int, *, kernel: str = "auto",
                        active_fraction: float = 1.0, glu: GLU = SWIGLU, store=None):
        """Stacked SwiGLU experts sharded over ep/etp (tiered with an enabled ``store``); ``auto``
        runs the reference loop."""
        return self.experts_module(ctx, num_experts, ffn_hidden_size, kernel=kernel,
                                   active_fraction=active_fraction, glu=glu, store=store)

    def shared_expert(self, ctx: BuildContext, cfg, layer_number: int = 0):
        """The MoE layer's shared SwiGLU expert (``SharedExpert``; ``add_to`` joins it to the routed output)."""
        return SharedExpert(cfg, ctx, layer_number)


def _norm(ctx: BuildContext, dim: int, sequence_parallel: bool, head_sharded: bool, eps, zero_centered, kernel):
    partial = (sequence_parallel and ctx.sp) or (head_sharded and ctx.groups.tp_size > 1)
    return RMSNorm(dim, ctx.norm_eps if eps is None else eps,
                   ctx.norm_zero_centered if zero_centered is None else zero_centered,
                   tp_partial_grad=partial, dtype=ctx.dtype, device=ctx.device, kernel=kernel)
