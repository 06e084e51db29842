"""Torch-native FP8 GEMMs (layers/ops/fp8/linear.py, layers/ops/fp8/experts.py).

Two references per op: the same quantisation emulated in float32 (dequantised operands, plain
matmul), which the scaled GEMM must match up to its bf16 result (so a wrong scale layout
fails), and the unquantised op, which FP8 must stay near (e4m3 keeps 3 mantissa bits: each
operand carries <= 2^-4 relative rounding, products of random operands land at ~3%).
The CPU build of torch runs ``torch._scaled_mm``; the one-launch grouped path is CUDA only
(the `gpu` test)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.layers.ops.fp8.linear import dequantize, fp8_linear, quantize
from megamoe.layers.ops.fp8.experts import aligned_layout, fp8_grouped_linear, swiglu_experts_fp8
from megamoe.layers.ops.grouped_gemm import swiglu_experts_reference
from megamoe.layers.mlp.dense import GLU
from tests.numerics import assert_close, rel_err

BF16_OUT = 1e-2   # the scaled GEMM's bf16 result against the fp32 emulation
FP8_VS_FP32 = 6e-2  # FP8 against the unquantised op


def _emulated(a, b):
    """a [M, K] @ b [K, N] with a quantised per row and b per column, in float32."""
    (aq, sa), (bq, sb) = quantize(a, 1), quantize(b, 0)
    return dequantize(aq, sa, torch.float32) @ dequantize(bq, sb, torch.float32)


def test_quantize_keeps_each_row_within_e4m3_rounding():
    t = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]   # rows six decades apart
    q, s = quantize(t, 1)
    assert s.shape == (8, 1) and q.dtype == torch.float8_e4m3fn
    back = dequantize(q, s, torch.float32)
    # relative to each row's own amax: 2^-4 of the value, or the subnormal step near zero
    bound = 2.0 ** -4 * t.abs() + 2.0 ** -9 * s * 448 / 2 ** 6
    assert ((back - t).abs() <= bound).all()
    assert torch.equal(quantize(torch.zeros(2, 16), 1)[0].float(), torch.zeros(2, 16))


def test_fp8_linear_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(3, 20, 64, requires_grad=True)
    w = (torch.randn(48, 64) * 0.05).requires_grad_()
    b = torch.randn(48, requires_grad=True)
    y = fp8_linear(x, w, b)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2 = x.detach().reshape(-1, 64)
    assert_close(y.detach().reshape(-1, 48), _emulated(x2, w.detach().t()) + b.detach(), BF16_OUT, "y vs emulation")
    assert_close(y, F.linear(x, w, b), FP8_VS_FP32, "y vs fp32")
    dy2 = dy.reshape(-1, 48)
    assert_close(x.grad.reshape(-1, 64), _emulated(dy2, w.detach()), BF16_OUT, "dx vs emulation")
    assert_close(x.grad.reshape(-1, 64), dy2 @ w.detach(), FP8_VS_FP32, "dx vs fp32")
    torch.testing.assert_close(w.grad, dy2.t() @ x2)              # weight gradient: high precision
    torch.testing.assert_close(b.grad, dy2.sum(0))


def test_fp8_linear_falls_back_on_widths_the_scaled_gemm_rejects():
    x, w = torch.randn(5, 24), torch.randn(40, 24)                 # K = 24 is not a multiple of 16
    assert torch.equal(fp8_linear(x, w), F.linear(x, w))


def _offsets(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def test_fp8_grouped_linear_matches_per_group_emulation_with_empty_groups():
    torch.manual_seed(1)
    counts = [5, 0, 17, 1, 0, 9]
    a = torch.randn(sum(counts), 32, requires_grad=True)
    w = (torch.randn(len(counts), 48, 32) * 0.1).requires_grad_()
    y = fp8_grouped_linear(a, w, _offsets(counts))
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_y, ref_da, ref_dw, start = [], [], torch.zeros_like(w), 0
    for g, n in enumerate(counts):
        sl = slice(start, start + n)
        start += n
        if n:
            ref_y.append(_emulated(a.detach()[sl], w.detach()[g].t()))
            ref_da.append(_emulated(dy[sl], w.detach()[g]))
            ref_dw[g] = dy[sl].t() @ a.detach()[sl]
    assert_close(y.detach(), torch.cat(ref_y), BF16_OUT, "y")
    assert_close(a.grad, torch.cat(ref_da), BF16_OUT, "da")
    torch.testing.assert_close(w.grad, ref_dw)


def _expert_inputs(seed, counts, h=32, f=48, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n_tok = 23
    x = torch.randn(n_tok, h, generator=g).to(device, dtype).requires_grad_()
    idx = torch.randint(0, n_tok, (sum(counts),), generator=g).to(device)
    probs = torch.rand(sum(counts), generator=g).to(device, dtype).requires_grad_()
    w1 = (torch.randn(len(counts), 2 * f, h, generator=g) * 0.2).to(device, dtype).requires_grad_()
    w2 = (torch.randn(len(counts), h, f, generator=g) * 0.2).to(device, dtype).requires_grad_()
    return x, idx, probs, w1, w2, n_tok


def _grads(kernel, counts, inputs, glu=GLU()):
    x, idx, probs, w1, w2, n_tok = inputs
    out = kernel(x, idx, counts, probs, w1, w2, n_tok, glu)
    dy = torch.ones_like(out).normal_(generator=torch.Generator(device=out.device).manual_seed(7))
    grads = torch.autograd.grad(out, (x, probs, w1, w2), dy)
    return (out, *grads)


# a clamp at 3 sigma: few entries sit near the bound, where FP8 rounding can flip which are clamped
@pytest.mark.parametrize("glu", [GLU(), GLU(3.0), GLU(3.0, 1.702, 1.0)], ids=["swiglu", "clamped", "oai"])
def test_fp8_swiglu_experts_stay_near_the_reference(glu):
    counts = [4, 0, 11, 3, 7]
    inputs = _expert_inputs(2, counts)
    got = _grads(swiglu_experts_fp8, counts, inputs, glu)
    ref = _grads(swiglu_experts_reference, counts, inputs, glu)
    for name, a, b in zip(("out", "dx", "dprobs", "dw1", "dw2"), got, ref):
        assert_close(a, b, 8e-2, name)


def test_fp8_swiglu_experts_decline_unaligned_widths():
    inputs = _expert_inputs(3, [2, 3], h=24)
    x, idx, probs, w1, w2, n = inputs
    assert swiglu_experts_fp8(x, idx, [2, 3], probs, w1, w2, n) is None


def test_aligned_layout_starts_every_group_on_a_16_row_boundary():
    counts = torch.tensor([5, 0, 17, 1, 16])
    dest, offs, bound = aligned_layout(counts, int(counts.sum()))
    assert offs.tolist() == [16, 16, 48, 64, 80] and bound >= 80
    starts = [0, 16, 16, 48, 64]
    expect = [starts[g] + i for g, n in enumerate(counts.tolist()) for i in range(n)]
    assert dest.tolist() == expect


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_swiglu_experts_on_cuda_against_bf16():
    counts = [40, 0, 130, 3, 77, 16]
    inputs = _expert_inputs(4, counts, h=256, f=128, dtype=torch.bfloat16, device="cuda")
    got = _grads(swiglu_experts_fp8, counts, inputs)
    ref = _grads(swiglu_experts_reference, counts, inputs)
    for name, a, b in zip(("out", "dx", "dprobs", "dw1", "dw2"), got, ref):
        assert_close(a, b, 8e-2, name)


# ---- the cuda backend's FP8 roles at TP=2 ---------------------------------------------------

def fp8_mlp_case(seed: int) -> dict:
    """An FP8 column -> SiLU -> row pair at this rank's TP layout against the fp32 MLP of one
    process (weights from the same shard-local initialisation); forward and every gradient."""
    import torch.distributed as dist

    from megamoe.layers.backends.cuda import FP8ColumnParallelLinear, FP8RowParallelLinear
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.parallel.sharding import gather_full
    from megamoe.model.weights import finalize_grads, full_state_dict, initialize

    tp = dist.group.WORLD if dist.get_world_size() > 1 else None
    groups = ParallelGroups(tp=tp)
    mlp = torch.nn.Sequential(FP8ColumnParallelLinear(64, 96, tp, bias=True, init_std=0.1),
                              torch.nn.SiLU(), FP8RowParallelLinear(96, 64, tp, init_std=0.1))
    initialize(mlp, groups, seed)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    y = mlp(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1))
    y.backward(dy)
    finalize_grads(mlp, groups)
    full = full_state_dict(mlp, groups)
    grads = {n: gather_full(p, groups, p.grad) for n, p in mlp.named_parameters()}
    w1, b1, w2 = (full[k].clone().requires_grad_() for k in ("0.weight", "0.bias", "2.weight"))
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(F.silu(F.linear(x_ref, w1, b1)), w2)
    y_ref.backward(dy)
    errs = {"y": rel_err(y, y_ref), "dx": rel_err(x.grad, x_ref.grad)}
    for name, ref in (("0.weight", w1), ("0.bias", b1), ("2.weight", w2)):
        errs[name] = rel_err(grads[name], ref.grad)
    return errs


def test_fp8_linear_roles_at_tp2_match_the_fp32_mlp(pool):
    one = pool(1).run(fp8_mlp_case, 5)[0]
    two = pool(2).run(fp8_mlp_case, 5)
    for errs in [one, *two]:
        assert max(errs.values()) < FP8_VS_FP32, errs
