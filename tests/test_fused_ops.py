"""Hand-written backwards of the small fused ops: the causal conv + SiLU of the linear mixers,
RMSNorm (plain, zero-centred, gated by SiLU or sigmoid) and the L2 norm of q/k.

Each against its unfused torch formula (forward and input/weight gradients, fp64 to 1e-12)
and torch's numerical gradient (gradcheck).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.layers.ops.conv import causal_conv
from megamoe.layers.ops.l2norm import l2norm
from megamoe.layers.norm import RMSNorm

TOL = 1e-12


def grads(out, inputs, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * g).sum(), inputs)


@pytest.mark.parametrize("t", [1, 2, 3, 64])
def test_causal_conv_equals_torch_conv1d(t):
    x = torch.randn(2, t, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y, state = causal_conv(x, w)
    full = torch.cat([x.new_zeros(2, 3, 6), x], 1)
    ref = F.silu(F.conv1d(full.transpose(1, 2), w.unsqueeze(1), groups=6).transpose(1, 2))
    assert (y - ref).abs().max() <= TOL
    assert torch.equal(state, full[:, -3:])  # the decode state: the last K-1 inputs, differentiable
    for a, b in zip(grads(y, (x, w)), grads(ref, (x, w))):
        assert (a - b).abs().max() <= TOL
    assert torch.autograd.gradcheck(lambda x, w: causal_conv(x, w)[0], (x, w))


@pytest.mark.parametrize("fuse", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("t", [2, 3, 64])
def test_causal_conv_from_a_state_equals_torch_conv1d(t, fuse):
    """From a state with gradients (a context-parallel chunk continues from its halo): conv1d
    over [state | x], forward and the gradients of x, the weight and the state."""
    x = torch.randn(2, t, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    y, new = causal_conv(x, w, state, fuse=fuse)
    full = torch.cat([state, x], 1)
    ref = F.silu(F.conv1d(full.transpose(1, 2), w.unsqueeze(1), groups=6).transpose(1, 2))
    assert (y - ref).abs().max() <= TOL and torch.equal(new, full[:, -3:])
    for a, b in zip(grads(y, (x, w, state)), grads(ref, (x, w, state))):
        assert (a - b).abs().max() <= TOL
    if not fuse:
        assert torch.autograd.gradcheck(lambda x, w, s: causal_conv(x, w, s)[0], (x, w, state))



def test_causal_conv_decode_step_equals_conv1d():
    """One token after a state (the decode step): torch's conv1d over [state | x], forward and
    gradients (the step is plain autograd ops), and the new state is the last K-1 inputs."""
    x = torch.randn(3, 1, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    state = torch.randn(3, 3, 6, dtype=torch.float64)
    y, new = causal_conv(x, w, state)
    full = torch.cat([state, x], 1)
    ref = F.silu(F.conv1d(full.transpose(1, 2), w.unsqueeze(1), groups=6).transpose(1, 2))
    assert y.shape == (3, 1, 6) and (y - ref).abs().max() <= TOL
    assert torch.equal(new, full[:, 1:])
    for a, b in zip(grads(y, (x, w)), grads(ref, (x, w))):
        assert (a - b).abs().max() <= TOL

def unfused_norm(x, w, zero_centered, gate, act):
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (w + 1 if zero_centered else w)
    if gate is not None:
        out = out * (F.silu(gate) if act == "silu" else torch.sigmoid(gate))
    return out


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("act", [None, "silu", "sigmoid"])
def test_rmsnorm_equals_unfused_formula(zero_centered, act):
    norm = RMSNorm(8, 1e-6, zero_centered, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True) if act else None
    inputs = (x, norm.weight) + ((gate,) if act else ())
    y = norm(x, gate=gate, gate_act=act or "silu")
    ref = unfused_norm(x, norm.weight, zero_centered, gate, act)
    assert (y - ref).abs().max() <= TOL
    for a, b in zip(grads(y, inputs), grads(ref, inputs)):
        assert (a - b).abs().max() <= TOL
    assert torch.autograd.gradcheck(lambda *a: norm(a[0], gate=a[2] if act else None, gate_act=act or "silu"),
                                    (x, norm.weight, gate if act else x))


def test_rmsnorm_of_bf16_computes_in_fp32():
    norm = RMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 8)
    y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert (y.float() - unfused_norm(x.bfloat16().float(), norm.weight, False, None, None)).abs().max() <= 2e-2


def test_l2norm_equals_formula():
    x = torch.randn(2, 7, 3, 16, dtype=torch.float64, requires_grad=True)
    y = l2norm(x)
    ref = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
    assert (y - ref).abs().max() <= TOL
    assert (grads(y, (x,))[0] - grads(ref, (x,))[0]).abs().max() <= TOL
    assert torch.autograd.gradcheck(l2norm, (x,))
