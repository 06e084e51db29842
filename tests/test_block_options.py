"""Layer-block options the converted families need, against plain-torch references (forward and
backward): hyper-connections (GLM-5, ``model.hyper_connections``), the scaled post-norm residual
(MiniMax, ``model.scaled_residual``) and the clamped SwiGLU (``swiglu_limit``, dense MLP and every
expert kernel); decoding through the residual streams; TP=2 (+SP) parity; config errors."""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import (AttentionConfig, HyperConnectionConfig, KDAConfig, LightningConfig, MLPConfig,
                                 ModelConfig, ScaledResidualConfig)
from megamoe.core.errors import ConfigError
from megamoe.parallel.groups import ParallelGroups
from tests.numerics import rel_err

REL = 1e-6


def tiny(layout: str = "AdKd", **kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=16, layout=layout, attention=AttentionConfig(num_heads=2, head_dim=8),
                mlp=MLPConfig(ffn_hidden_size=24), kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=4),
                lightning=LightningConfig(num_heads=2, block_size=4), init_std=0.2)
    base.update(kw)
    return ModelConfig(**base)


def built(cfg: ModelConfig, seed: int = 0):
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize

    model = LanguageModel(cfg)
    initialize(model, model.groups, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # move the constant-initialised parameters (norms, hc base/scale) off their init
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def info_for(s: int, b: int = 2):
    from megamoe.layers.spec import ForwardInfo

    return ForwardInfo(positions=torch.arange(s).expand(b, -1))


# ---- hyper-connections -------------------------------------------------------------------------

def hc_token_reference(x_tok, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float):
    """One token's (pre [n], post [n], comb [n, n]) written out as the GLM-5 recipe states it."""
    v = x_tok.reshape(-1).double()
    v = v / torch.sqrt(v.pow(2).mean() + norm_eps)
    z = fn.double() @ v
    base, scale = base.double(), scale.double()
    pre = torch.sigmoid(z[:n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(z[n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax((z[2 * n:] * scale[2] + base[2 * n:]).view(n, n), dim=1) + eps
    comb = comb / (comb.sum(0, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(1, keepdim=True) + eps)
        comb = comb / (comb.sum(0, keepdim=True) + eps)
    return pre, post, comb


def hc_reference(hc, x, block):
    """x [b, s, n, h] through ``block`` with token-by-token, stream-by-stream loops (float64)."""
    b, s, n, _ = x.shape
    weights = [[hc_token_reference(x[i, t], hc.fn, hc.base, hc.scale, n, hc.iters, hc.eps, hc.norm_eps)
                for t in range(s)] for i in range(b)]
    collapsed = torch.stack([torch.stack([sum(weights[i][t][0][k] * x[i, t, k].double() for k in range(n))
                                          for t in range(s)]) for i in range(b)])
    y = block(collapsed)
    out = [[torch.stack([weights[i][t][1][j] * y[i, t] + sum(weights[i][t][2][k, j] * x[i, t, k].double()
                                                            for k in range(n)) for j in range(n)])
            for t in range(s)] for i in range(b)]
    return torch.stack([torch.stack(row) for row in out])


def test_hyper_connection_matches_reference_forward_and_backward():
    from megamoe.layers.hyper_connection import HyperConnection
    from megamoe.model.language_model import build_context
    from megamoe.model.weights import initialize

    cfg = tiny(hyper_connections=HyperConnectionConfig(streams=3, sinkhorn_iters=20))
    hc = HyperConnection(cfg.hyper_connections, build_context(cfg))
    initialize(hc, ParallelGroups(), 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hc.base.normal_(0, 0.5, generator=gen)
        hc.scale.normal_(1, 0.3, generator=gen)
    w_block = torch.randn(16, 16, generator=gen, dtype=torch.float64) * 0.3
    block = lambda y: torch.tanh(y.double() @ w_block).to(y.dtype)  # noqa: E731  (any token-mixing-free map)
    x = torch.randn(2, 4, 3, 16, generator=gen)
    g = torch.randn(2, 4, 3, 16, generator=gen, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = hc(xa, block)
    (ours.double() * g).sum().backward()
    ours_grads = [xa.grad] + [p.grad.clone() for p in (hc.fn, hc.base, hc.scale)]
    hc.zero_grad()
    ref = hc_reference(hc, xb, block)
    (ref * g).sum().backward()
    assert rel_err(ours, ref) <= REL
    for got, want in zip(ours_grads, [xb.grad, hc.fn.grad, hc.base.grad, hc.scale.grad]):
        assert rel_err(got, want) <= 1e-5
    pre, post, comb = hc.weights(x)
    assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-5)  # columns sum to one after the last step
    assert torch.allclose(comb.sum(-1), torch.ones(()), atol=1e-3)  # rows nearly (20 steps)


def test_hyper_connection_model_streams_and_decoding():
    """The embedding enters every stream, the head reads their mean, and decoding one token at a
    time (KDA state + KV cache through the streams) equals the full forward."""
    from megamoe.layers.cache.decode import InferenceCache

    model = built(tiny(hyper_connections=HyperConnectionConfig(streams=3)))
    assert sum(p.numel() for n, p in model.named_parameters() if "_hc." in n) == 2 * 2 * (5 * 3 * (3 * 16 + 1) + 3)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = InferenceCache(2)
        steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(4, 9)]
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-5
    assert full.std() > 0.1  # a real signal


# ---- scaled residual ---------------------------------------------------------------------------

def test_scaled_residual_layer_matches_reference():
    """n = norm(x); h = a n + b mixer(n); n2 = norm(h); out = a' n2 + b' mlp(n2) (not x + f(norm x))."""
    from megamoe.model.language_model import ScaledResidualLayer

    scaled = ScaledResidualConfig(mixer_alpha={"L": 1.7}, mixer_beta={"L": 0.6, "A": 3.0}, mlp_alpha=0.8, mlp_beta=1.3)
    model = built(tiny("LdAd", scaled_residual=scaled))
    layer = model.layers["0"]
    assert isinstance(layer, ScaledResidualLayer)
    assert (layer.mixer_alpha, layer.mixer_beta) == (1.7, 0.6) and model.layers["1"].mixer_beta == 3.0
    rms = lambda v, w: v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + model.config.norm_eps) * w  # noqa: E731
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = layer(xa, info_for(7))
    n1 = rms(xb, layer.input_norm.weight)
    h = 1.7 * n1 + 0.6 * layer.mixer(n1, info_for(7))
    n2 = rms(h, layer.pre_mlp_norm.weight)
    ref = 0.8 * n2 + 1.3 * layer.mlp(n2)
    assert rel_err(ours, ref) <= REL
    ours.sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    ref.sum().backward()
    assert rel_err(xa.grad, xb.grad) <= REL
    for name, p in layer.named_parameters():
        assert rel_err(grads[name], p.grad) <= REL, name
    plain = x + layer.mixer(layer.input_norm(x), info_for(7))
    assert rel_err(plain, h) > 0.1  # the option changes the maths


# ---- parallel == single -------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["hyper", "scaled"])
def test_tp2_sp_equals_tp1(pool, option):
    from tests.test_tensor_parallel import over_tolerance, tp_parity_case

    extra = (dict(hyper_connections=HyperConnectionConfig(streams=2)) if option == "hyper" else
             dict(scaled_residual=ScaledResidualConfig(mixer_alpha={"A": 1.5}, mlp_beta=0.7)))
    cfg = tiny("AdLd", hidden_size=32, attention=AttentionConfig(num_heads=4, head_dim=8), **extra)
    for rank, errs in enumerate(pool(2).run(tp_parity_case, cfg, 2, True, 0, True)):
        bad = over_tolerance(errs, 1e-5)
        assert not bad, f"rank {rank}: relative errors over 1e-5 (or 3x the fp32 noise floor): {bad}"
        assert max(v for k, v in errs.items() if k.startswith("floor ")) < 1e-4  # the floor is rounding, not a bug
        assert any("_hc." in k for k in errs) == (option == "hyper")


def test_pp2_training_equals_dp2_with_hyper_connections(pool, tmp_path):
    """The [b, s, n, h] streams cross the pipeline cut: PP=2 follows DP=2's loss curve (both equal
    the single-process one, tests/test_trainer_parity.py)."""
    import dataclasses

    from megamoe.core.config import ParallelConfig
    from tests.test_trainer_parity import check_pp2_equals_dp2, tiny_recipe

    recipe = tiny_recipe(ParallelConfig(), steps=4)
    recipe.model = dataclasses.replace(recipe.model, hyper_connections=HyperConnectionConfig(streams=2))
    check_pp2_equals_dp2(pool, recipe, tmp_path)


# ---- clamped SwiGLU ---------------------------------------------------------------------------

def test_clamped_mlp_matches_reference():
    from megamoe.layers.mlp.dense import SwiGLUMLP
    from megamoe.model.language_model import build_context
    from megamoe.model.weights import initialize

    cfg = tiny(mlp=MLPConfig(ffn_hidden_size=24, swiglu_limit=0.3))
    mlp = SwiGLUMLP(cfg.mlp, build_context(cfg))
    initialize(mlp, ParallelGroups(), 0)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    gate, up = (x @ mlp.linear_fc1.weight.t()).chunk(2, dim=-1)
    assert (gate > 0.3).any() and (up.abs() > 0.3).any()  # the clamp is active
    ref = (torch.nn.functional.silu(gate.clamp(max=0.3)) * up.clamp(-0.3, 0.3)) @ mlp.linear_fc2.weight.t()
    assert rel_err(mlp(x), ref) <= REL


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_clamped_expert_kernels_match_reference(kernel):
    """The loop kernel's hand-written backward masks the clamped entries like autograd does."""
    from megamoe.layers.ops.grouped_gemm import grouped_mm_support, swiglu_experts
    from megamoe.layers.mlp.dense import GLU

    if kernel == "grouped_mm" and grouped_mm_support(torch.device("cpu"), torch.float32):
        pytest.skip(grouped_mm_support(torch.device("cpu"), torch.float32))
    gen = torch.Generator().manual_seed(0)
    counts, h, f, limit = [3, 0, 5, 4], 16, 8, 0.4
    x = torch.randn(9, h, generator=gen)
    idx = torch.randint(0, 9, (sum(counts),), generator=gen)
    probs = torch.rand(sum(counts), generator=gen)
    w1, w2 = torch.randn(4, 2 * f, h, generator=gen) * 0.3, torch.randn(4, h, f, generator=gen) * 0.3
    g = torch.randn(9, h, generator=gen)
    results = {}
    for name in ("reference", kernel):
        leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2, probs)]
        out = swiglu_experts(name, leaves[0], idx, counts, leaves[3], leaves[1], leaves[2], 9, GLU(limit))
        (out * g).sum().backward()
        results[name] = [out] + [t.grad for t in leaves]
    for ours, ref in zip(results[kernel], results["reference"]):
        assert rel_err(ours, ref) <= REL
    # the reference against the formula for one row of expert 0, and the clamp changes the result
    row = x[idx[0]]
    gate, up = (w1[0] @ row).chunk(2)
    want = probs[0] * (w2[0] @ (torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)))
    one = swiglu_experts("reference", x, idx[:1], [1, 0, 0, 0], probs[:1], w1, w2, 9, GLU(limit))
    assert rel_err(one[idx[0]], want) <= REL
    assert rel_err(swiglu_experts("reference", x, idx, counts, probs, w1, w2, 9), results["reference"][0]) > 0.05


def test_swiglu_oai_matches_minimax_m3():
    """SwiGLU-OAI (``swiglu_alpha``, ``swiglu_limit``): the dense MLP equals transformers'
    MiniMaxM3VLDenseMLP with the same weights, forward and gradients, with entries on both
    sides of the clamp; the experts' unit equals MiniMaxM3VLExperts._apply_gate."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m

    from megamoe.layers.mlp.dense import GLU, SwiGLUMLP, glu_act
    from megamoe.model.language_model import build_context

    text = m.MiniMaxM3VLTextConfig(hidden_size=16, dense_intermediate_size=12, swiglu_limit=0.6)
    hf = m.MiniMaxM3VLDenseMLP(text)
    cfg = tiny(mlp=MLPConfig(ffn_hidden_size=12, swiglu_limit=0.6, swiglu_alpha=1.702))
    ours = SwiGLUMLP(cfg.mlp, build_context(cfg))
    with torch.no_grad():
        for p, q in ((ours.linear_fc1.weight, hf.gate_up_proj.weight), (ours.linear_fc2.weight, hf.down_proj.weight)):
            q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel())) * 0.5)
            p.copy_(q)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    pre = hf.gate_up_proj(x)
    assert (pre.abs() > 0.6).float().mean() > 0.2  # the clamp bites
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = ours(xa), hf(xb)
    assert rel_err(ya, yb) <= REL
    (ya * ya).sum().backward()
    (yb * yb).sum().backward()
    assert rel_err(xa.grad, xb.grad) <= REL
    assert rel_err(ours.linear_fc1.weight.grad, hf.gate_up_proj.weight.grad) <= REL
    experts = m.MiniMaxM3VLExperts(m.MiniMaxM3VLTextConfig(hidden_size=16, intermediate_size=12, swiglu_limit=0.6))
    assert torch.equal(glu_act(pre, GLU(0.6, 1.702, 1.0)), experts._apply_gate(pre))


# ---- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(hyper_connections=HyperConnectionConfig(), scaled_residual=ScaledResidualConfig()),
     "model.hyper_connections.*cannot be combined with model.scaled_residual"),
    (dict(scaled_residual=ScaledResidualConfig(mixer_alpha={"X": 2.0})), r"model.scaled_residual.mixer_alpha=\['X'\]"),
    (dict(hyper_connections=HyperConnectionConfig(streams=0)), "model.hyper_connections.streams=0"),
    (dict(mlp=MLPConfig(swiglu_limit=-1.0)), "model.mlp.swiglu_limit=-1.0"),
])
def test_config_errors_are_one_line(kw, message):
    with pytest.raises(ConfigError, match=message) as err:
        tiny(**kw).validate()
    assert "\n" not in str(err.value)
