"""The backend contract: every role of every available backend against ``local`` (the pure-torch
reference), outputs and every gradient, on the same weights and inputs.

Tolerances (fp32, ``rel_err`` = ||a - b|| / ||b||): 1e-6 where a backend
runs the same ops in another order (linears, attention cores, the router GEMM); 1e-5 where the
algorithm differs (hand-written backwards, chunked against recurrent linear-attention ops, the
expert loop against the reference loop). Awkward lengths (T = 21 with chunks of 8) cross
chunk boundaries and leave a partial chunk.
"""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import MLPConfig
from megamoe.layers.backends import get_backend
from megamoe.layers.mlp.dense import GLU
from megamoe.parallel.groups import ParallelGroups
from tests.backend_utils import CPU_BACKENDS as BACKENDS, ctx_for, cuda_on_cpu_registered
from tests.numerics import rel_err


@pytest.fixture(autouse=True, scope="module")
def _cuda_on_cpu():
    with cuda_on_cpu_registered():
        yield


EXACT, ALGO = 1e-6, 1e-5


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def outputs_and_grads(fn, inputs: list, params: list = (), seed: int = 99) -> list[torch.Tensor]:
    """fn(*inputs) (a tensor or a tuple; the first of a tuple is the output, the rest carried
    states), and the gradients of every floating input and parameter for a fixed random
    cotangent on each output."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    cot = [randn(*o.shape, seed=seed + i) for i, o in enumerate(outs)]
    wrt = [x for x in leaves if x.requires_grad] + list(params)
    grads = torch.autograd.grad(outs, wrt, cot, allow_unused=True)
    return [o.detach() for o in outs] + [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]


def assert_close(got, want, tol):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert rel_err(a, b) <= tol, f"tensor {i}: rel err {rel_err(a, b):.2e} > {tol}"


def twin_modules(build, backend: str):
    """The same module from ``backend`` and from ``local``, with equal parameter values."""
    torch.manual_seed(0)
    mine, ref = build(ctx_for(backend)), build(ctx_for("local"))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    mine.load_state_dict(ref.state_dict())
    return mine, ref


def check_module(build, backend, call, inputs, tol):
    mine, ref = twin_modules(build, backend)
    got = outputs_and_grads(lambda *x: call(mine, *x), inputs, list(mine.parameters()))
    want = outputs_and_grads(lambda *x: call(ref, *x), inputs, list(ref.parameters()))
    assert_close(got, want, tol)


def check_fn(role, backend, call, inputs, tol):
    mine, ref = role(get_backend(backend)), role(get_backend("local"))
    assert_close(outputs_and_grads(lambda *x: call(mine, *x), inputs),
                 outputs_and_grads(lambda *x: call(ref, *x), inputs), tol)


pytestmark = pytest.mark.parametrize("backend", BACKENDS)


# ---- linears, norms, attention cores, router -------------------------------------------------

@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
def test_linears(backend, kind):
    def build(ctx):
        b = ctx.backend
        if kind == "column":
            return b.column_linear(ctx, 16, [12, 8], bias=True)
        if kind == "row":
            return b.row_linear(ctx, 12, 16, bias=True)
        return b.replicated_linear(ctx, 16, 6)

    width = 12 if kind == "row" else 16
    check_module(build, backend, lambda m, x: m(x), [randn(2, 5, width)], EXACT)


@pytest.mark.parametrize("zero_centered,gate_act", [(False, None), (True, None), (True, "silu"), (False, "sigmoid")])
def test_norms(backend, zero_centered, gate_act):
    build = lambda ctx: ctx.backend.norm(ctx, 8, zero_centered=zero_centered)  # noqa: E731
    rows = randn(3, 5, 20)[..., 4:12]  # a strided head slice, as the mixers pass it
    if gate_act is None:
        check_module(build, backend, lambda m, x: m(x), [rows], ALGO)
    else:
        check_module(build, backend, lambda m, x, g: m(x, gate=g, gate_act=gate_act), [rows, randn(3, 5, 8, seed=1)],
                     ALGO)


def test_sharded_norm(backend):
    check_module(lambda ctx: ctx.backend.sharded_norm(ctx, 8), backend, lambda m, x: m(x), [randn(2, 3, 8)], EXACT)


@pytest.mark.parametrize("window,t_q", [(0, 7), (3, 7), (0, 2)])  # causal, sliding window, queries at the end
def test_core_attention(backend, window, t_q):
    core = lambda b: b.core_attention(None, softmax_scale=0.3, window=window)  # noqa: E731
    q, k, v = randn(2, t_q, 4, 8), randn(2, 7, 2, 8, seed=1), randn(2, 7, 2, 6, seed=2)  # GQA: 4 query heads, 2 kv
    check_fn(core, backend, lambda m, q, k, v: m(q, k, v), [q, k, v], EXACT)


def test_latent_attention_cores(backend):
    from megamoe.layers.ops.attention.core import causal_mask

    q_lat, q_rope, c, k_rope = randn(2, 3, 4, 10), randn(2, 3, 4, 4, seed=1), randn(2, 9, 10, seed=2), randn(2, 9, 4, seed=3)
    mask = causal_mask(3, 9)
    check_fn(lambda b: b.latent_attention(None), backend, lambda f, *x: f(*x, 0.25, mask), [q_lat, q_rope, c, k_rope],
             EXACT)
    idx = torch.tensor([[[0, 3, -1], [1, 2, 7], [8, 4, 5]]]).expand(2, 3, 3)  # -1: no key
    check_fn(lambda b: b.sparse_latent_attention(None), backend, lambda f, *x: f(*x, idx, 0.25),
             [q_lat, q_rope, c, k_rope], EXACT)


def test_router_gemm(backend):
    check_fn(lambda b: b.router_logits(None), backend, lambda f, x, w: f(x, w), [randn(11, 16), randn(6, 16, seed=1)],
             EXACT)


# ---- linear-attention ops and the short convolution ------------------------------------------

@pytest.mark.parametrize("heads_first", [False, True])
def test_l2_norm(backend, heads_first):
    check_fn(lambda b: b.l2_norm(None), backend, lambda f, x: f(x, scale=0.25, heads_first=heads_first),
             [randn(2, 7, 3, 16)], ALGO)


@pytest.mark.parametrize("t,with_state", [(2, False), (21, False), (3, True)])
def test_short_conv(backend, t, with_state):
    inputs = [randn(2, t, 12), randn(12, 4, seed=1, scale=0.5)] + ([randn(2, 3, 12, seed=2)] if with_state else [])
    check_fn(lambda b: b.short_conv(None), backend, lambda f, *x: f(*x), inputs, ALGO)


def delta_inputs(t: int, per_channel: bool, seed: int = 0):
    """q, k [b, t, hk, dk] unit-norm, v [b, t, hv, dv], g (log decay) and beta, h0 [b, hv, dk, dv]."""
    b, hk, hv, dk, dv = 2, 2, 4 if not per_channel else 2, 8, 6
    q = torch.nn.functional.normalize(randn(b, t, hk, dk, seed=seed), dim=-1)
    k = torch.nn.functional.normalize(randn(b, t, hk, dk, seed=seed + 1), dim=-1)
    v = randn(b, t, hv, dv, seed=seed + 2)
    g_shape = (b, t, hv, dk) if per_channel else (b, t, hv)
    g = -torch.nn.functional.softplus(randn(*g_shape, seed=seed + 3))
    beta = torch.sigmoid(randn(b, t, hv, seed=seed + 4))
    return [q, k, v, g, beta, randn(b, hv, dk, dv, seed=seed + 5, scale=0.3)]


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("form,t", [("chunked", 21), ("recurrent", 1), ("recurrent", 3)])
def test_delta_rule(backend, per_channel, form, t):
    def call(op, q, k, v, g, beta, h0):
        if form == "chunked":
            return op.chunked(q, k, v, g, beta, scale=0.4, initial_state=h0, chunk_size=8)
        return op.recurrent(q, k, v, g, beta, scale=0.4, initial_state=h0)

    check_fn(lambda b: b.delta_rule(None), backend, call, delta_inputs(t, per_channel), ALGO)


@pytest.mark.parametrize("form,t", [("chunked", 21), ("recurrent", 1)])
def test_lightning(backend, form, t):
    q, k, v = randn(2, t, 3, 8, scale=0.5), randn(2, t, 3, 8, seed=1, scale=0.5), randn(2, t, 3, 6, seed=2)
    slope = torch.tensor([0.5, 0.1, 0.02], dtype=torch.float64)

    def call(op, q, k, v, h0):
        if form == "chunked":
            return op.chunked(q, k, v, slope, h0, block=8)
        return op.recurrent(q, k, v, slope, h0)

    check_fn(lambda b: b.lightning(None), backend, call, [q, k, v, randn(2, 3, 8, 6, seed=3)], ALGO)


# ---- experts -------------------------------------------------------------------------------

@pytest.mark.parametrize("with_probs,glu", [(True, GLU()), (False, GLU(0.5)), (True, GLU(0.5, 1.702, 1.0))],
                         ids=["swiglu", "clamped", "oai"])
def test_grouped_experts(backend, with_probs, glu):
    counts = [5, 0, 9, 2]
    idx = torch.randint(0, 7, (16,), generator=torch.Generator().manual_seed(1))
    build = lambda ctx: ctx.backend.grouped_experts(ctx, 4, 6, glu=glu)  # noqa: E731

    def call(m, x, p):
        return m(x, idx, counts, p if with_probs else None, 7)

    check_module(build, backend, call, [randn(7, 16), torch.sigmoid(randn(16, seed=2))], ALGO)


@pytest.mark.parametrize("gate", [True, False])
def test_shared_expert(backend, gate):
    build = lambda ctx: ctx.backend.shared_expert(ctx, MLPConfig(ffn_hidden_size=12, swiglu_limit=None))  # noqa: E731
    inputs = [randn(2, 5, 16), randn(2, 5, 16, seed=1)] + ([randn(1, 16, seed=2, scale=0.3)] if gate else [])
    check_module(build, backend, lambda m, out, x, *g: m.add_to(out, x, g[0] if g else None), inputs, ALGO)


# ---- LoRA around whatever role a backend returned ------------------------------------------

def with_adapter(role, **lora):
    """``role`` wrapped in a LoRA adapter (rank 3, scale 2), in place; ``twin_modules`` then draws
    every parameter, the factors included (B would start at zero)."""
    from megamoe.lora import LoRAConfig
    from megamoe.lora.adapters import attach

    attach(role, LoRAConfig(rank=3, alpha=6.0, **lora), ParallelGroups())
    return role


def adapted(build, parts=None, **lora):
    """A build function whose role (or, with ``parts``, those sub-roles of it) carries adapters."""
    def wrapped(ctx):
        role = build(ctx)
        for sub in [getattr(role, p) for p in parts] if parts else [role]:
            with_adapter(sub, **lora)
        return role
    return wrapped


@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
def test_lora_linears(backend, kind):
    """The adapted linear role against local's: output, input, base weight, bias and both factors."""
    build = {"column": lambda ctx: ctx.backend.column_linear(ctx, 16, [12, 8], bias=True),
             "row": lambda ctx: ctx.backend.row_linear(ctx, 12, 16, bias=True),
             "replicated": lambda ctx: ctx.backend.replicated_linear(ctx, 16, 6)}[kind]
    width = 12 if kind == "row" else 16
    check_module(adapted(build), backend, lambda m, x: m(x), [randn(2, 5, width)], EXACT)


@pytest.mark.parametrize("expert_adapters", ["per_expert", "shared"])
def test_lora_grouped_experts(backend, expert_adapters):
    """The adapters inside each expert's SwiGLU, in the form of the backend's expert kernel,
    against local's (the reference loop under autograd)."""
    counts = [5, 0, 9, 2]
    idx = torch.randint(0, 7, (16,), generator=torch.Generator().manual_seed(1))
    build = adapted(lambda ctx: ctx.backend.grouped_experts(ctx, 4, 6, glu=GLU(0.9, 1.702, 1.0)),
                    expert_adapters=expert_adapters)
    check_module(build, backend, lambda m, x, p: m(x, idx, counts, p, 7),
                 [randn(7, 16), torch.sigmoid(randn(16, seed=2))], ALGO)


def test_lora_shared_expert(backend):
    """Adapters on the shared expert's linears (the CPU backend then runs its modules' form)."""
    build = adapted(lambda ctx: ctx.backend.shared_expert(ctx, MLPConfig(ffn_hidden_size=12, swiglu_limit=None)),
                    parts=("linear_fc1", "linear_fc2"))
    inputs = [randn(2, 5, 16), randn(2, 5, 16, seed=1), randn(1, 16, seed=2, scale=0.3)]
    check_module(build, backend, lambda m, out, x, g: m.add_to(out, x, g), inputs, ALGO)


# ---- a whole model ----------------------------------------------------------------------------

def test_hybrid_model(backend):
    """Every role at once: GDN, KDA, gated GQA with q/k norms, MLA, lightning, routed + gated
    shared experts; the loss and every parameter gradient."""
    from megamoe.core.config import MoEConfig
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.weights import initialize
    from tests.mixer_utils import tiny_model

    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(0))
    results = []
    for name in (backend, "local"):
        cfg = tiny_model("GeKdAeMdLe", backend=name,
                         moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, num_shared_experts=1,
                                       shared_expert_gate=True))
        model = LanguageModel(cfg)
        assert model.ctx.backend.name == name
        initialize(model, ParallelGroups(), seed=0)
        loss = model(ids, labels=shift_labels(ids))
        loss.backward()
        results.append([loss.detach()] + [p.grad for _, p in sorted(model.named_parameters()) if p.grad is not None])
    assert len(results[0]) == len(results[1]) > 30
    assert_close(results[0], results[1], ALGO)
