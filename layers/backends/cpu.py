"""``cpu``: the CPU fast paths, the default on machines without CUDA.

Hand-written backwards (RMSNorm, the short convolution, the L2 norm, the per-head chunked
gated delta rule, the expert loop kernel, the fused shared expert) whose elementwise chains
run compiled where the instance's ``Fusion`` is active; the chunked forms of the linear-
attention ops (recurrent steps for decoding). Plain torch otherwise, so it runs on any device.
"""
from __future__ import annotations

import functools

import torch

from megamoe.core.config import MLPConfig
from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.layers.ops.grouped_gemm import grouped_mm_support, shared_swiglu_add
from megamoe.layers.mlp.dense import SWIGLU, GLU
from megamoe.layers.spec import BuildContext
from megamoe.layers.backends.base import BaseBackend
from megamoe.layers.backends.local import _norm
from megamoe.layers.ops.lightning import lightning_chunked, lightning_recurrent
from megamoe.layers.ops.delta_rule.chunk import chunk_delta_rule
from megamoe.layers.ops.attention.tiles import CPU_FLASH, CUDA_FLASH, MATH
from megamoe.layers.ops.conv import causal_conv
from megamoe.layers.ops.l2norm import l2norm
from megamoe.layers.ops.delta_rule.naive import recurrent_delta_rule
from megamoe.layers.ops.delta_rule.passing import chunk_gated_delta_rule_passing, widened_passing
from megamoe.layers.norm import HandwrittenRMSNorm
from megamoe.layers.mlp.shared_expert import SharedExpert


class ChunkedDeltaRule:
    """``chunk_delta_rule`` (fused per ``fusion``) for sequences, the recurrence for decode steps."""

    def __init__(self, fusion):
        self.fusion = fusion

    def chunked(self, q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                recompute: bool = False):
        # the op computes in fp32 by design (as fla's kernels do); under autocast its products would
        # run in bf16 and the chunk scan's out= products refuse their fp32 buffers
        with torch.autocast(v.device.type, enabled=False):
            return chunk_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                    chunk_size=chunk_size, recompute=recompute, fuse=self.fusion.active(v.device))

    def recurrent(self, q, k, v, g, beta, *, scale=None, initial_state=None):
        return recurrent_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def passing(self, q, k, v, g, beta, link, *, scale=None, chunk_size: int = 64, recompute: bool = False):
        """The chunk batches of a context-parallel sequence, states passed through ``link``
        (``megamoe.layers.ops.delta_rule.passing``): the per-head op passes them itself, the
        per-channel one (KDA) runs widened."""
        with torch.autocast(v.device.type, enabled=False):  # fp32 by design, as ``chunked``
            if g.dim() == 3:
                return chunk_gated_delta_rule_passing(q, k, v, g, beta, link, scale=scale, chunk_size=chunk_size,
                                                      fuse=self.fusion.active(v.device), recompute=recompute)
            return widened_passing(self.chunked, q, k, v, g, beta, link, scale=scale, chunk_size=chunk_size,
                                   recompute=recompute)


class ChunkedLightning:
    def chunked(self, q, k, v, slope, initial_state=None, block: int = 64, resets=None):
        """``resets`` [b, t] bool: packed documents (``megamoe.layers.mixers.lightning``)."""
        return lightning_chunked(q, k, v, slope, initial_state, block=block, resets=resets)

    def recurrent(self, q, k, v, slope, initial_state=None):
        return lightning_recurrent(q, k, v, slope, initial_state)


class _Fused:
    """``fn(*args, fuse=<policy for the first tensor's device>, **kwargs)``."""

    def __init__(self, fn, fusion):
        self.fn, self.fusion = fn, fusion
        functools.update_wrapper(self, fn)

    def __call__(self, x, *args, **kwargs):
        return self.fn(x, *args, fuse=self.fusion.active(x.device), **kwargs)


def _only_weight(m: torch.nn.Module) -> bool:
    """``[n for n, _ in m.named_parameters()] == ["weight"]`` without walking the module tree
    (a decode step asks once per MoE layer)."""
    own = [n for n, p in m._parameters.items() if p is not None]
    return own == ["weight"] and not any(True for c in m.children() for _ in c.parameters())


class FusedSharedExpert(SharedExpert):
    """The CPU backend's: one op with the routed output (``shared_swiglu_add``: the gate applied
    to the intermediate, the output GEMM accumulating into ``out``) where the expert is a plain
    one-rank SwiGLU on CPU outside autocast; otherwise (TP, a bias, adapters on its linears)
    the modules' form."""

    def __init__(self, cfg: MLPConfig, ctx: BuildContext, layer_number: int = 0, *, fusion: Fusion = EAGER):
        super().__init__(cfg, ctx, layer_number)
        self.fusion, self.tp_size = fusion, ctx.groups.tp_size

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether ``add_to`` runs fused for this input. The fused op reads only the two weights
        and communicates nothing, so the linears must hold nothing else (no bias, no adapter)
        and be whole (one TP rank)."""
        return (self.tp_size == 1 and x.device.type == "cpu" and not torch.is_autocast_enabled(x.device.type)
                and _only_weight(self.linear_fc1) and _only_weight(self.linear_fc2))

    def add_to(self, out: torch.Tensor, x: torch.Tensor, gate_w: torch.Tensor | None) -> torch.Tensor:
        if not self.fuses(x):
            return super().add_to(out, x, gate_w)
        h = x.size(-1)
        return shared_swiglu_add(out.reshape(-1, h), x.reshape(-1, h), self.linear_fc1.weight, self.linear_fc2.weight,
                                 gate_w, self.glu, self.fusion.active(x.device)).view(x.shape)

    def two_parts(self, x: torch.Tensor, gate_w: torch.Tensor | None):
        """Fused: all of it in the first part (one op), the second hands it over."""
        if not self.fuses(x):
            return super().two_parts(x, gate_w)
        done: list[torch.Tensor] = []
        return (lambda: done.append(self.add_to(torch.zeros_like(x), x, gate_w))), done.pop


def accelerated_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """``cpu``'s and ``cuda``'s ``auto`` expert kernel: torch's grouped GEMM on an accelerator
    where its probe passes, the loop kernel otherwise (it beat the grouped GEMM on CPU)."""
    return "grouped_mm" if device.type != "cpu" and grouped_mm_support(device, dtype) is None else "loop"


class FusedTiles:
    """Ring attention's tile kernel by the tensors' device: torch's CPU or CUDA flash kernels
    (``megamoe.layers.ops.attention.tiles``), the math tiles elsewhere."""

    name = "fused"
    BY_DEVICE = {"cpu": CPU_FLASH, "cuda": CUDA_FLASH}

    def forward(self, q, *args, **kw):
        return self.BY_DEVICE.get(q.device.type, MATH).forward(q, *args, **kw)

    def backward(self, do, q, *args, **kw):
        return self.BY_DEVICE.get(q.device.type, MATH).backward(do, q, *args, **kw)


FUSED = FusedTiles()


class CpuBackend(BaseBackend):
    name = "cpu"
    auto_expert_kernel = staticmethod(accelerated_kernel)

    def norm(self, ctx: BuildContext, dim: int, *, sequence_parallel: bool = False, head_sharded: bool = False,
             eps: float | None = None, zero_centered: bool | None = None):
        """RMSNorm with the hand-written backward (see ``LocalBackend.norm`` for the arguments)."""
        return _norm(ctx, dim, sequence_parallel, head_sharded, eps, zero_centered, HandwrittenRMSNorm(self.fusion))

    def l2_norm(self, ctx: BuildContext):
        return _Fused(l2norm, self.fusion)

    def short_conv(self, ctx: BuildContext):
        return _Fused(causal_conv, self.fusion)

    def delta_rule(self, ctx: BuildContext):
        return ChunkedDeltaRule(self.fusion)

    def attention_tiles(self):
        """Ring attention's tiles on torch's fused kernels with the log-sum-exp (CPU flash; CUDA
        flash for fp16/bf16), math tiles where a mask needs them (``FusedTiles``)."""
        return FUSED

    def lightning(self, ctx: BuildContext):
        return ChunkedLightning()

    def grouped_experts(self, ctx: BuildContext, num_experts: int, ffn_hidden_size: int, *, kernel: str = "auto",
                        active_fraction: float = 1.0, glu: GLU = SWIGLU, store=None):
        """Stacked SwiGLU experts (tiered with an enabled ``store``); ``auto`` runs the loop kernel
        (torch's grouped GEMM where it works on an accelerator), its SwiGLU passes fused per ``fusion``."""
        return self.experts_module(ctx, num_experts, ffn_hidden_size, kernel=kernel, active_fraction=active_fraction,
                                   glu=glu, store=store)

    def shared_expert(self, ctx: BuildContext, cfg, layer_number: int = 0):
        return FusedSharedExpert(cfg, ctx, layer_number, fusion=self.fusion)
