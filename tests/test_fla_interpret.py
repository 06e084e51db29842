"""The cuda backend's fla calls through Triton's interpreter, on CPU tensors (marked ``interpret``;
run by tools/fla_interpret.sh, skipped everywhere else: the main test environment has no fla).

Each role of the cuda backend that calls fla (the delta rule's chunked and fused-recurrent
forms for GDN and KDA, Lightning as fla's simple GLA) against the ``local`` backend's
recurrence on the same inputs: outputs, final states and, where fla has a backward, every
input gradient (the fused-recurrent GDN and KDA ops are forward-only in fla: decoding).
Tiny shapes (the interpreter runs each program instance in numpy); lengths 5 (one partial
chunk) and 70 (across fla's 64-token chunk); two value heads per key head for GDN; an
initial state throughout. Tolerance 1e-5 (fp32, measured ~1e-6: only the order of the sums
differs). The backend is told that its CPU tensors are fla's (``_on_fla``), so the calls are
exactly those it makes on a GPU.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import rel_err

pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(importlib.util.find_spec("fla") is None or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="fla through Triton's interpreter: bash tools/fla_interpret.sh")]
TOL = 1e-5


@pytest.fixture(autouse=True)
def fla_on_cpu(monkeypatch):
    from megamoe.layers.backends import cuda

    monkeypatch.setattr(cuda, "_on_fla", lambda t: True)


def _ops(role: str):
    from megamoe.layers.backends.cuda import CudaBackend
    from megamoe.layers.backends.local import LocalBackend

    return getattr(CudaBackend(), role)(None), getattr(LocalBackend(), role)(None)


def _run(fn, inputs, grads: bool, seed: int = 7):
    """fn(*inputs) -> (o, state): [o, state] plus, with ``grads``, every input's gradient for a
    fixed random cotangent on both."""
    leaves = [x.clone().requires_grad_(grads) for x in inputs]
    o, state = fn(*leaves)
    out = [o.detach(), state.detach()]
    if grads:
        gen = torch.Generator().manual_seed(seed)
        loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
        out += torch.autograd.grad(loss, leaves)
    return out


def _check(got, want, names):
    errs = {n: rel_err(a, b) for n, a, b in zip(names, got, want)}
    assert len(got) == len(want) and all(torch.isfinite(a).all() for a in got), errs
    assert max(errs.values()) <= TOL, errs


def _delta_inputs(t: int, kda: bool, seed: int = 0):
    """q, k [1, t, hk, 16]; v [1, t, hv, 16]; g [1, t, hv] or [1, t, hv, 16]; beta; h0 [1, hv, 16, 16]."""
    gen = torch.Generator().manual_seed(seed)
    hk, hv, d = (2, 2, 16) if kda else (1, 2, 16)
    q = F.normalize(torch.randn(1, t, hk, d, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, t, hk, d, generator=gen), dim=-1)
    v = torch.randn(1, t, hv, d, generator=gen)
    g = -torch.rand((1, t, hv, d) if kda else (1, t, hv), generator=gen)
    beta = torch.rand(1, t, hv, generator=gen)
    h0 = torch.randn(1, hv, d, d, generator=gen) * 0.3
    return [q, k, v, g, beta, h0]


NAMES = ("out", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.mark.parametrize("t", [5, 70])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_chunked_delta_rule(t, kda):
    mine, ref = _ops("delta_rule")
    scale = None if kda else 1.0  # the GDN mixer scales q itself; KDA leaves it to the op
    inputs = _delta_inputs(t, kda)
    got = _run(lambda *x: mine.chunked(*x[:5], scale=scale, initial_state=x[5]), inputs, True)
    want = _run(lambda *x: ref.chunked(*x[:5], scale=scale, initial_state=x[5]), inputs, True)
    _check(got, want, NAMES)


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_decode_delta_rule(t, kda):
    """fla's fused-recurrent ops (decode steps; forward only). Before the keyword call, the GDN
    form put beta into fla's ``gk`` and gave NaN."""
    mine, ref = _ops("delta_rule")
    scale = None if kda else 1.0
    inputs = _delta_inputs(t, kda, seed=1)
    got = _run(lambda *x: mine.recurrent(*x[:5], scale=scale, initial_state=x[5]), inputs, False)
    want = _run(lambda *x: ref.recurrent(*x[:5], scale=scale, initial_state=x[5]), inputs, False)
    _check(got, want, NAMES)


@pytest.mark.parametrize("role", ["gdn", "kda", "lightning"])
def test_decode_in_bf16(role):
    """A decode step at bf16 (generation's dtype) against the fp32 recurrence: the dtypes the
    backend hands fla (bf16 q, k, v and beta, fp32 decays and state) run, within bf16's rounding
    (measured 2e-3 to 6e-3). The chunked kernels cannot run at bf16 here: the interpreter keeps
    bf16 as raw 16-bit integers and its ``tl.dot`` and arithmetic act on the bit patterns (the
    fused-recurrent kernels cast to fp32 first); tests/test_gpu.py runs them at bf16."""
    half = torch.bfloat16
    if role == "lightning":
        mine, ref = _ops("lightning")
        gen = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, 3, 2, 16, generator=gen) * 0.3 for _ in range(3))
        h0, slope = torch.randn(1, 2, 16, 16, generator=gen) * 0.3, torch.tensor([0.5, 0.05])
        got = mine.recurrent(q.to(half), k.to(half), v.to(half), slope, h0)
        want = ref.recurrent(q, k, v, slope, h0)
    else:
        mine, ref = _ops("delta_rule")
        q, k, v, g, beta, h0 = _delta_inputs(3, role == "kda", seed=1)
        scale = None if role == "kda" else 1.0
        got = mine.recurrent(q.to(half), k.to(half), v.to(half), g, beta.to(half), scale=scale, initial_state=h0)
        want = ref.recurrent(q, k, v, g, beta, scale=scale, initial_state=h0)
    assert got[0].dtype == half and got[1].dtype == torch.float32
    errs = [rel_err(a.float(), b) for a, b in zip(got, want)]
    assert max(errs) <= 1e-2, errs


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_bf16_chunked_calls_at_the_contract_tests_widths_take_compiled_dot_shapes(kda):
    """The chunked ops at bf16 and the head widths of tests/test_gpu.py's contract model (keys 8,
    values 12: below the 16 a compiled bf16 ``tl.dot`` needs), forward and backward: every
    ``tl.dot`` meets the compiled kernels' shape rule (tools/triton_site checks it) and the
    outputs have the shapes and dtypes the backend promises. Values are not compared: the
    interpreter computes bf16 on raw bit patterns (test_decode_in_bf16)."""
    mine, _ = _ops("delta_rule")
    gen = torch.Generator().manual_seed(4)
    hk, hv, dk, dv, t = 2, 2 if kda else 4, 8, 12, 11
    q, k = (F.normalize(torch.randn(1, t, hk, dk, generator=gen), dim=-1).bfloat16() for _ in range(2))
    v, beta = torch.randn(1, t, hv, dv, generator=gen).bfloat16(), torch.rand(1, t, hv, generator=gen).bfloat16()
    g = -torch.rand((1, t, hv, dk) if kda else (1, t, hv), generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    o, state = mine.chunked(*leaves, scale=None if kda else 1.0)
    grads = torch.autograd.grad(o.float().sum() + state.sum(), leaves)
    assert o.shape == (1, t, hv, dv) and o.dtype == torch.bfloat16
    assert state.shape == (1, hv, dk, dv) and state.dtype == torch.float32
    assert [x.shape for x in grads] == [x.shape for x in leaves]


def test_bf16_lightning_at_the_contract_tests_width_takes_compiled_dot_shapes():
    """Lightning's chunked forward at bf16 and head width 8, as above (its backward stops in the
    interpreter, which has no bf16 scalar constants: ``InterpreterBuilder.get_bf16``)."""
    mine, _ = _ops("lightning")
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 11, 4, 8, generator=gen).bfloat16() for _ in range(3))
    o, state = mine.chunked(q, k, v, torch.tensor([0.5, 0.2, 0.05, 0.01]))
    assert o.shape == (1, 11, 4, 8) and o.dtype == torch.bfloat16
    assert state.shape == (1, 4, 8, 8) and state.dtype == torch.float32


def test_decode_continues_the_chunked_state():
    """A prefill through the chunked op, then a decode step from its state: the recurrence's."""
    mine, ref = _ops("delta_rule")
    q, k, v, g, beta, _ = _delta_inputs(9, False, seed=2)
    _, state = mine.chunked(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], scale=1.0)
    o, final = mine.recurrent(q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:], beta[:, 8:], scale=1.0, initial_state=state)
    want_o, want_state = ref.chunked(q, k, v, g, beta, scale=1.0)
    _check([o, final], [want_o[:, 8:], want_state], NAMES)


@pytest.mark.parametrize("t,form", [(5, "chunked"), (70, "chunked"), (1, "recurrent"), (3, "recurrent")])
def test_lightning(t, form):
    mine, ref = _ops("lightning")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, t, 2, 16, generator=gen) * 0.3 for _ in range(3))
    h0 = torch.randn(1, 2, 16, 16, generator=gen) * 0.3
    slope = torch.tensor([0.5, 0.05])
    got = _run(lambda *x: getattr(mine, form)(*x[:3], slope, x[3]), [q, k, v, h0], True)
    want = _run(lambda *x: getattr(ref, form)(*x[:3], slope, x[3]), [q, k, v, h0], True)
    _check(got, want, ("out", "state", "dq", "dk", "dv", "dh0"))
