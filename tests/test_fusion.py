"""Compiled elementwise kernels (megamoe.layers.ops.fusion) against the eager ones they stand in for.

Each fused autograd op (the expert SwiGLU, the fused shared expert, RMSNorm, the causal conv,
the L2 norm, the chunked gated delta rule's backward) runs once with fusion on and once off on
the same fp32 inputs: outputs and every gradient agree to 1e-5 relative. A hybrid MoE model (Gated DeltaNet, gated attention with
q/k norms, routed + gated shared experts) built with ``model.fusion=on`` agrees in loss and all
gradients with the same model built with ``off`` in the same process (the policy belongs to
each model's backend). The rest of the suite runs eagerly (tests/conftest.py); these tests
skip where no C++ compiler is found.
"""
from __future__ import annotations

import pytest
import torch

from megamoe.layers.ops import fusion
from megamoe.core.config import GDNConfig, MoEConfig
from megamoe.core.errors import ConfigError
from tests.mixer_utils import tiny_model
from tests.numerics import rel_err

needs_compiler = pytest.mark.skipif(not fusion._have_cxx(), reason="no C++ compiler for inductor's CPU kernels")
TOL = 1e-5


@pytest.fixture
def modes():
    """run(fn) -> (fn(fuse=True), fn(fuse=False))."""
    return lambda fn: (fn(True), fn(False))


def fwd_bwd(fn, inputs, seed=1234):
    """(output, grads of inputs) of fn(*inputs) for a fixed random output gradient."""
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(out, [x for x in inputs if x.requires_grad], g, allow_unused=True)
    return [out.detach(), *(d for d in grads if d is not None)]  # unused inputs (no probs, no gate) drop out


def assert_close(fused, eager, tol=TOL):
    assert len(fused) == len(eager)
    for i, (a, b) in enumerate(zip(fused, eager)):
        assert rel_err(a, b) <= tol, f"tensor {i}: rel err {rel_err(a, b):.2e}"


def assert_compiled(*fns):
    for f in fns:
        assert f.compiled is not None and not f.broken, f"{f.__qualname__} did not run compiled"


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- ops ------------------------------------------------------------------------------------

@needs_compiler
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("glu", [(None,), (0.5,), (0.5, 1.702, 1.0)], ids=["swiglu", "clamped", "oai"])
def test_expert_loop(modes, with_probs, glu, monkeypatch):
    from megamoe.layers.ops import grouped_gemm as gg
    from megamoe.layers.mlp.dense import GLU

    glu = GLU(*glu)

    monkeypatch.setattr(gg, "BLOCK_ROWS", 6)  # two blocks: experts 0 and 2, then 3

    counts = [5, 0, 9, 2]
    idx = torch.randint(0, 7, (16,), generator=torch.Generator().manual_seed(1))
    inputs = [randn(7, 8), randn(16, seed=2).sigmoid(), randn(4, 12, 8, seed=3, scale=0.5),
              randn(4, 8, 6, seed=4, scale=0.5)]

    def run(fuse):
        return fwd_bwd(lambda x, p, w1, w2: gg.swiglu_experts_loop(x, idx, counts, p if with_probs else None, w1, w2,
                                                                   7, glu, fuse), inputs)
    fused, eager = modes(run)
    assert_close(fused, eager)
    assert_compiled(gg.swiglu_weighted, gg.swiglu_weighted_backward)


@needs_compiler
@pytest.mark.parametrize("gate,glu", [(True, (None,)), (False, (0.5,)), (True, (0.5, 1.702, 1.0))],
                         ids=["swiglu", "clamped", "oai"])
def test_shared_expert(modes, gate, glu):
    from megamoe.layers.ops import grouped_gemm as gg
    from megamoe.layers.mlp.dense import GLU

    glu = GLU(*glu)

    inputs = [randn(10, 8), randn(10, 8, seed=1), randn(12, 8, seed=2, scale=0.5), randn(8, 6, seed=3, scale=0.5),
              randn(1, 8, seed=4)]
    fused, eager = modes(lambda fuse: fwd_bwd(
        lambda y, x, w1, w2, g: gg.shared_swiglu_add(y, x, w1, w2, g if gate else None, glu, fuse), inputs))
    assert_close(fused, eager)


@needs_compiler
@pytest.mark.parametrize("zero_centered,act", [(False, None), (True, "silu"), (False, "sigmoid")])
def test_rmsnorm(modes, zero_centered, act):
    from megamoe.layers.norm import HandwrittenRMSNorm, RMSNorm, _norm_fused

    norm = RMSNorm(8, 1e-6, zero_centered)
    with torch.no_grad():
        norm.weight.copy_(randn(8, seed=5))
    rows = randn(3, 5, 20)[..., 4:12]  # strided, like a head slice of a projection
    inputs = [rows, norm.weight] + ([randn(3, 5, 8, seed=6)] if act else [])
    def run(fuse):
        norm.kernel = HandwrittenRMSNorm(fusion.Fusion("on" if fuse else "off"))
        return fwd_bwd(lambda x, w, *g: RMSNorm.forward(norm, x, gate=g[0] if g else None, gate_act=act or "silu"),
                       inputs)

    fused, eager = modes(run)
    assert_close(fused, eager)
    assert_compiled(_norm_fused)


@needs_compiler
@pytest.mark.parametrize("t", [2, 19])
def test_causal_conv(modes, t):
    from megamoe.layers.ops.conv import _conv_silu_fused, causal_conv

    inputs = [randn(2, t, 30)[..., :12], randn(12, 4, seed=1, scale=0.5)]  # t < K - 1 and t > K
    fused, eager = modes(lambda fuse: fwd_bwd(lambda x, w: causal_conv(x, w, None, fuse)[0], inputs))
    assert_close(fused, eager)
    assert_compiled(_conv_silu_fused)


@needs_compiler
@pytest.mark.parametrize("heads_first", [True, False])
def test_l2norm(modes, heads_first):
    from megamoe.layers.ops.l2norm import _l2norm_fused, l2norm

    x = randn(2, 7, 3, 16)
    fused, eager = modes(lambda fuse: fwd_bwd(lambda x: l2norm(x, scale=0.25, heads_first=heads_first, fuse=fuse),
                                              [x]))
    assert_close(fused, eager)
    assert_compiled(_l2norm_fused)
    y = l2norm(x, heads_first=heads_first, fuse=True)
    assert y.transpose(1, 2).is_contiguous() == heads_first  # the layout the chunked op reads


@needs_compiler
def test_gated_delta_rule_backward(modes):
    """The per-head chunked op's backward runs its elementwise part fused (``intra_grads``):
    value heads sharing key heads, a length that leaves a partial chunk, an initial state."""
    from megamoe.layers.ops.delta_rule.chunk_gated import chunk_gated_delta_rule, intra_grads
    from tests.test_delta_rule import make_inputs

    q, k, v, g, beta, h0 = make_inputs(45, False, seed=3, b=2, hk=2, hv=4, dk=16, dv=8, decay_scale=4.0)
    fused, eager = modes(lambda fuse: fwd_bwd(
        lambda q, k, v, g, beta, h0: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=16,
                                                            fuse=fuse)[0],
        [q, k, v, g, beta, h0]))
    assert_close(fused, eager)
    assert_compiled(intra_grads)


# ---- a model ----------------------------------------------------------------------------------

def hybrid_moe(fusion_mode: str):
    from megamoe.model.language_model import LanguageModel
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.model.weights import initialize

    cfg = tiny_model("GeAe", gdn=GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                                          chunk_size=8),
                     moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, num_shared_experts=1,
                                   shared_expert_gate=True), fusion=fusion_mode)
    model = LanguageModel(cfg)
    initialize(model, ParallelGroups(), seed=0)
    return model


@needs_compiler
def test_hybrid_moe_model():
    from megamoe.model.language_model import shift_labels

    fused_model, eager_model = hybrid_moe("on"), hybrid_moe("off")  # side by side in one process
    ids = torch.randint(0, fused_model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))

    def run(model):
        loss = model(ids, labels=shift_labels(ids))
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for _, p in sorted(model.named_parameters()) if p.grad is not None]

    fused, eager = run(fused_model), run(eager_model)
    assert len(fused) > 20
    assert_close(fused, eager)
    from megamoe.layers.ops import grouped_gemm as gg
    from megamoe.layers.ops.delta_rule.chunk_gated import intra_grads
    from megamoe.layers.norm import _norm_fused

    assert_compiled(_norm_fused, gg.swiglu_weighted, intra_grads)


# ---- the policy ------------------------------------------------------------------------------

def test_modes_and_errors():
    assert not fusion.Fusion("off").active(torch.device("cpu"))
    assert fusion.Fusion("on").active(torch.device("cpu"))
    assert not fusion.Fusion("auto").active(torch.device("meta"))  # accelerators keep their own kernels
    with pytest.raises(ConfigError, match=r"model.fusion='fast' is invalid: allowed: auto, on, off"):
        fusion.Fusion("fast")
    cfg = tiny_model("Ad", fusion="fast")
    with pytest.raises(ConfigError, match=r"model.fusion"):
        cfg.validate()


def test_each_model_keeps_its_own_policy():
    """Building a model sets nothing process-wide: every fusing role of a model (the CPU
    backend's) follows that model's backend, whatever was built before or after it."""
    on, off = hybrid_moe("on"), hybrid_moe("off")
    for model, mode in ((on, "on"), (off, "off")):
        assert model.ctx.backend.name == "cpu" and model.ctx.backend.fusion.mode == mode
        roles = [m.kernel for m in model.modules() if hasattr(m, "kernel") and hasattr(m.kernel, "fusion")]
        for m in model.modules():
            roles += [getattr(m, a) for a in ("conv", "l2norm", "op") if hasattr(getattr(m, a, None), "fusion")]
            roles += [m] if hasattr(m, "fusion") else []
        kinds = {type(r).__name__ for r in roles}
        assert {"HandwrittenRMSNorm", "GroupedExperts", "FusedSharedExpert", "ChunkedDeltaRule", "_Fused"} <= kinds, kinds
        assert all(r.fusion is model.ctx.backend.fusion for r in roles)


def test_recipe_key_sets_the_backend_policy(monkeypatch):
    from megamoe.model.language_model import build_context
    from megamoe.recipe import load_recipe

    for value, expected in [("off", "off"), ("on", "on"), ("auto", "auto")]:  # bare YAML on/off are booleans
        recipe = load_recipe("tiny_train", [f"model.fusion={value}"])
        assert recipe.model.fusion == expected
        assert build_context(recipe.model).backend.fusion.mode == expected
    assert load_recipe("quickstart_vlm").model.fusion == "off"
    recipe = load_recipe("tiny_train")
    recipe.model.fusion = None  # unset: the environment decides, when the model is built
    monkeypatch.setenv("MEGAMOE_FUSION", "on")
    assert build_context(recipe.model).backend.fusion.mode == "on"
    monkeypatch.setenv("MEGAMOE_FUSION", "sometimes")
    with pytest.raises(ConfigError, match=r"MEGAMOE_FUSION='sometimes' is invalid"):
        build_context(recipe.model)


def test_a_failed_compile_falls_back_once(caplog):
    double = fusion.fused(lambda x: 2 * x)

    def broken_compiler(*args):
        raise RuntimeError("no compiler here\nsecond line")

    double.compiled = broken_compiler
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))  # the eager result
    assert double.broken
    assert "compiling" in caplog.text and "no compiler here" in caplog.text and "second line" not in caplog.text


def test_an_input_error_is_raised_as_eagerly():
    add = fusion.fused(lambda x, y: x + y)
    with pytest.raises(RuntimeError, match="must match the size"):
        add(torch.ones(2), torch.ones(3))
    assert not add.broken
