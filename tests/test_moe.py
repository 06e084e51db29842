"""MoE units: expert kernels against the reference, routing maths, capacity, balancing losses and
their gradient injection, metrics, config errors, placement by layout, the 1T preset's budget."""
from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megamoe.core.config import ModelConfig, MoEConfig, ParallelConfig, validate_model_parallel
from megamoe.core.errors import ConfigError
from tests.numerics import rel_err
from tests.presets import meta_budget

H = 16


def moe_layer(backend: str = "auto", **kw):
    from megamoe.layers.mlp.moe import MoELayer
    from megamoe.model.language_model import build_context
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.model.weights import initialize

    base = dict(num_experts=6, top_k=2, moe_ffn_hidden_size=8)
    cfg = ModelConfig(hidden_size=H, layout="Ae", moe=MoEConfig(**{**base, **kw}), backend=backend)
    layer = MoELayer(cfg.moe, build_context(cfg), 0)
    initialize(layer, ParallelGroups(), seed=0)
    return layer


# ---- kernels -----------------------------------------------------------------------------

@pytest.mark.parametrize("kernel,block_rows", [("loop", 4096), ("loop", 4), ("grouped_mm", None)])
@pytest.mark.parametrize("with_probs", [True, False])
def test_expert_kernels_match_reference(kernel, block_rows, with_probs, monkeypatch):
    from megamoe.layers.ops import grouped_gemm
    from megamoe.layers.ops.grouped_gemm import grouped_mm_support, swiglu_experts

    if block_rows is not None:  # 4: blocks of one and of two experts (3 | 5 | 4 rows)
        monkeypatch.setattr(grouped_gemm, "BLOCK_ROWS", block_rows)
    if kernel == "grouped_mm" and grouped_mm_support(torch.device("cpu"), torch.float32):
        pytest.skip(grouped_mm_support(torch.device("cpu"), torch.float32))
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 0, 4]  # empty experts in the middle and a token used by several experts
    x = torch.randn(11, H, generator=gen)
    idx = torch.randint(0, 11, (sum(counts),), generator=gen)
    probs = torch.rand(sum(counts), generator=gen) if with_probs else None
    w1 = torch.randn(5, 2 * 8, H, generator=gen) * 0.3
    w2 = torch.randn(5, H, 8, generator=gen) * 0.3
    g = torch.randn(11, H, generator=gen)
    results = {}
    for name in ("reference", kernel):
        leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        p = None if probs is None else probs.clone().requires_grad_(True)
        out = swiglu_experts(name, leaves[0], idx, counts, p, leaves[1], leaves[2], 11)
        (out * g).sum().backward()
        results[name] = [out] + [t.grad for t in leaves] + ([] if p is None else [p.grad])
    for ours, ref in zip(results[kernel], results["reference"]):
        assert rel_err(ours, ref) <= 1e-6
    for name in results:  # an empty expert gets a zero gradient
        assert results[name][2][1].abs().max() == 0 and results[name][3][3].abs().max() == 0



@pytest.mark.parametrize("glu", [(None,), (0.5,), (0.5, 1.702, 1.0)], ids=["swiglu", "clamped", "oai"])
def test_loop_kernel_without_autograd_equals_its_autograd_form(glu):
    """A forward without autograd (a decode step) with few pairs runs torch's grouped GEMM where
    it works, else the loop's maths directly: the same output as the autograd form, bitwise."""
    from megamoe.layers.ops.grouped_gemm import swiglu_experts
    from megamoe.layers.mlp.dense import GLU

    glu = GLU(*glu)
    gen = torch.Generator().manual_seed(1)
    counts = [3, 0, 5, 0, 4]
    x = torch.randn(11, H, generator=gen)
    idx = torch.randint(0, 11, (sum(counts),), generator=gen)
    probs = torch.rand(sum(counts), generator=gen)
    w1 = torch.randn(5, 2 * 8, H, generator=gen) * 0.3
    w2 = torch.randn(5, H, 8, generator=gen) * 0.3
    with torch.enable_grad():
        ref = swiglu_experts("loop", x, idx, counts, probs, w1.requires_grad_(True), w2, 11, glu)
    with torch.no_grad():
        got = swiglu_experts("loop", x, idx, counts, probs, w1, w2, 11, glu)
    assert torch.equal(got, ref.detach())

def test_loop_kernel_makes_no_weight_gradient_for_frozen_experts():
    """Frozen weights (LoRA elsewhere, tiered experts whose w1/w2 are views of a whole layer in
    a mapped store): the loop kernel's backward allocates nothing of their size, and the input
    gradient is the one computed with the weights trainable."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megamoe.layers.ops.grouped_gemm import swiglu_experts

    gen = torch.Generator().manual_seed(2)
    counts = [3, 0, 5, 0, 4]
    x = torch.randn(11, H, generator=gen)
    idx = torch.randint(0, 11, (sum(counts),), generator=gen)
    w1, w2 = torch.randn(5, 16, H, generator=gen) * 0.3, torch.randn(5, H, 8, generator=gen) * 0.3
    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.extend(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor))
            return out

    grads = []
    for trainable in (True, False):
        xg = x.clone().requires_grad_()
        y = swiglu_experts("loop", xg, idx, counts, None, w1.clone().requires_grad_(trainable),
                           w2.clone().requires_grad_(trainable), 11)
        with Shapes():
            y.pow(2).sum().backward()
        grads.append(xg.grad)
        assert (tuple(w1.shape) in shapes) == trainable and (tuple(w2.shape) in shapes) == trainable
        shapes.clear()
    assert torch.equal(grads[0], grads[1])


def test_auto_kernel_is_the_backends_choice():
    """``auto`` is resolved by the backend that built the experts: the loop kernel on CPU for
    ``cpu`` (and ``cuda``, which falls back to it off the GPU), the reference loop for ``local``;
    a name that is no kernel is a one-line error."""
    from megamoe.layers.backends.cpu import CpuBackend
    from megamoe.layers.backends.cuda import CudaBackend
    from megamoe.layers.backends.local import LocalBackend
    from megamoe.layers.ops.grouped_gemm import check_kernel

    cpu = torch.device("cpu")
    assert CpuBackend.auto_expert_kernel(cpu, torch.float32) == "loop"
    assert CudaBackend.auto_expert_kernel(cpu, torch.float32) == "loop"
    assert LocalBackend.auto_expert_kernel(cpu, torch.float32) == "reference"
    assert moe_layer("cpu").experts.resolved_kernel() == "loop"
    assert moe_layer("local").experts.resolved_kernel() == "reference"
    with pytest.raises(ConfigError, match="expert_kernel"):
        check_kernel("fast", cpu, torch.float32)
    with pytest.raises(ConfigError, match="expert_kernel"):
        check_kernel("auto", cpu, torch.float32)  # the backend's to resolve, never a kernel


# ---- routing maths -----------------------------------------------------------------------

@pytest.mark.parametrize("score_topk,expected", [(2, [2, 3]), (1, [0, 1])])
def test_group_limited_routing_by_hand(score_topk, expected):
    """Groups {0,1} {2,3} {4,5}; one group allowed. Sum of the best two picks group 1
    (0.5+0.45 > 0.6+0.0); the max picks group 0 (0.6 > 0.5), even though expert 2 beats expert 1."""
    from megamoe.layers.mlp.router import select_experts

    cfg = MoEConfig(num_experts=6, top_k=2, n_group=3, topk_group=1, group_score_topk=score_topk,
                    norm_topk_prob=False, routed_scaling_factor=2.0)
    scores = torch.tensor([[0.6, 0.0, 0.5, 0.45, 0.1, 0.1]])
    weights, idx = select_experts(scores, cfg)
    assert sorted(idx[0].tolist()) == expected
    assert torch.allclose(weights, scores.gather(1, idx) * 2.0)


def test_router_runs_in_fp32_in_a_bf16_model():
    """bf16 weights and activations: logits, scores, routing weights and the expert bias stay fp32."""
    from megamoe.layers.mlp.moe import MoELayer
    from megamoe.model.language_model import build_context
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.model.weights import initialize

    cfg = ModelConfig(hidden_size=H, layout="Ae", params_dtype="bfloat16",
                      moe=MoEConfig(num_experts=6, top_k=2, moe_ffn_hidden_size=8, expert_bias=True,
                                    score_function="sigmoid"))
    layer = MoELayer(cfg.moe, build_context(cfg), 0)
    initialize(layer, ParallelGroups(), seed=0)
    x = torch.randn(2 * 5, H, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert layer.router.weight.dtype == torch.bfloat16 and layer.router.expert_bias.dtype == torch.float32
    assert layer.router.logits(x).dtype == torch.float32
    routing = layer.router(x, 2)
    assert routing.weights.dtype == torch.float32
    ref = torch.sigmoid(x.float() @ layer.router.weight.float().t())  # the fp32 scores the choice is made on
    assert torch.equal(routing.idx.sort(-1).values, ref.topk(2, -1).indices.sort(-1).values)
    assert layer(x.view(2, 5, H)).dtype == torch.bfloat16


def test_expert_bias_changes_the_choice_not_the_weight():
    from megamoe.layers.mlp.router import select_experts

    cfg = MoEConfig(num_experts=4, top_k=1, norm_topk_prob=False)
    scores = torch.tensor([[0.5, 0.4, 0.3, 0.2]])
    weights, idx = select_experts(scores, cfg, bias=torch.tensor([0.0, 0.0, 0.5, 0.0]))
    assert idx.item() == 2 and weights.item() == pytest.approx(0.3)


@pytest.mark.parametrize("policy,kept", [("probs", [1, 3]), ("position", [0, 1])])
def test_capacity_drop_policies(policy, kept):
    from megamoe.layers.mlp.router import capacity_keep

    weights = torch.tensor([[0.1], [0.9], [0.5], [0.7], [0.2]])
    idx = torch.tensor([[0], [0], [0], [0], [1]])
    keep = capacity_keep(weights, idx, num_experts=2, capacity=2, policy=policy)
    assert keep[:4, 0].nonzero().flatten().tolist() == kept and keep[4, 0]


def test_capacity_drops_reach_the_output_and_metrics():
    from megamoe.model.moe_controls import moe_metrics

    dropless, capped = moe_layer(), moe_layer(capacity_factor=0.5)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(0))
    y0, y1 = dropless(x), capped(x)
    m = moe_metrics(capped)[0]
    assert m["dropped_tokens"] > 0 and 0 < m["dropped_fraction"] < 1
    assert rel_err(y1, y0) > 1e-3  # dropped pairs lose their expert output


# ---- balancing losses --------------------------------------------------------------------

def hand_losses(logits, idx, score_function, e, k, batch):
    """Independent formulas: Switch/GShard load balancing (load normalised by T*k), the same
    per sequence averaged over sequences, and the z-loss."""
    scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    p = scores / scores.sum(-1, keepdim=True)
    t = logits.size(0)
    onehot = torch.zeros(t, e).scatter_(1, idx, 1.0)
    aux = e * (onehot.sum(0) / (t * k) * p.mean(0)).sum()
    s = t // batch
    seq = torch.stack([e * (onehot[i * s:(i + 1) * s].sum(0) / (s * k) * p[i * s:(i + 1) * s].mean(0)).sum()
                       for i in range(batch)]).mean()
    z = torch.logsumexp(logits, -1).square().mean()
    return {"aux_loss": aux, "seq_aux_loss": seq, "z_loss": z}


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_balancing_losses_reach_the_gradient_without_the_caller(score_function):
    from megamoe.layers.mlp.router import select_experts
    from megamoe.model.moe_controls import moe_metrics, set_aux_loss_scale

    coeffs = dict(aux_loss_coeff=0.1, seq_aux_loss_coeff=0.2, z_loss_coeff=0.01)
    with_aux, plain = moe_layer(score_function=score_function, **coeffs), moe_layer(score_function=score_function)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(2, 5, H, generator=gen), torch.randn(2, 5, H, generator=gen)
    (with_aux(x) * g).sum().backward()
    # the same by hand: the main loss plus the weighted losses, added explicitly
    logits = plain.router.logits(x.reshape(-1, H))
    scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    _, idx = select_experts(scores, plain.router.cfg)
    hand = hand_losses(logits, idx, score_function, 6, 2, batch=2)
    loss = (plain(x) * g).sum() + sum(coeffs[f"{n}_coeff"] * v for n, v in hand.items())
    loss.backward()
    assert rel_err(with_aux.router.weight.grad, plain.router.weight.grad) <= 1e-6
    metrics = moe_metrics(with_aux)[0]
    for name, value in hand.items():
        assert metrics[name] == pytest.approx(value.item(), rel=1e-6), name
    # scale 0 (e.g. a frozen router) removes exactly the injected part
    no_aux = moe_layer(score_function=score_function)
    (no_aux(x) * g).sum().backward()
    set_aux_loss_scale(with_aux, 0.0)
    with_aux.zero_grad()
    (with_aux(x) * g).sum().backward()
    assert rel_err(with_aux.router.weight.grad, no_aux.router.weight.grad) <= 1e-7
    assert rel_err(plain.router.weight.grad, no_aux.router.weight.grad) > 1e-3


def test_eval_mode_adds_no_loss_and_no_load():
    layer = moe_layer(aux_loss_coeff=0.1, expert_bias=True)
    x = torch.randn(1, 4, H, generator=torch.Generator().manual_seed(2))
    y_train = layer(x)
    layer.router.load, layer.router.stats = None, {}
    layer.eval()
    with torch.no_grad():
        y_eval = layer(x)
    assert torch.equal(y_train, y_eval)
    assert layer.router.load is None and "aux_loss" not in layer.router.stats


def test_metrics_count_tokens_per_expert():
    from megamoe.model.moe_controls import moe_metrics

    layer = moe_layer()
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    layer(x)
    layer(x)
    _, idx = torch.topk(torch.softmax(layer.router.logits(x.reshape(-1, H)), -1), 2)
    m = moe_metrics(layer)[0]
    counts = torch.bincount(idx.flatten(), minlength=6).float() * 2
    assert m["tokens_per_expert"] == counts.tolist()
    assert m["imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
    assert 0 < m["router_entropy"] <= math.log(6)
    assert moe_metrics(layer) == {}  # read resets



def test_recording_off_leaves_metrics_and_outputs_alone():
    """``recording(model, False)`` (what decode steps run under): eval forwards add nothing to
    ``moe_metrics`` and give the same output; the setting is restored after the block."""
    from megamoe.model.moe_controls import moe_metrics, recording

    layer = moe_layer().eval()
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        counted = layer(x)
        with recording(layer, False):
            quiet = layer(x)
        assert layer.router.record_stats
        layer(x)
    assert torch.equal(counted, quiet)
    _, idx = torch.topk(torch.softmax(layer.router.logits(x.reshape(-1, H)), -1), 2)
    assert moe_metrics(layer)[0]["tokens_per_expert"] == (torch.bincount(idx.flatten(), minlength=6).float() * 2).tolist()

# ---- config ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,parallel,message", [
    (dict(num_experts=6, top_k=8), {}, "model.moe.top_k=8 is invalid"),
    (dict(num_experts=6, n_group=4), {}, "model.moe.n_group=4 is invalid: must divide num_experts=6"),
    (dict(num_experts=8, n_group=4, topk_group=5), {}, "model.moe.topk_group=5"),
    (dict(score_function="relu"), {}, "model.moe.score_function='relu' is invalid: allowed: softmax, sigmoid"),
    (dict(dispatcher="nccl"), {}, "model.moe.dispatcher"),
    (dict(capacity_factor=0.0), {}, "model.moe.capacity_factor"),
    (dict(shared_expert_gate=True), {}, "model.moe.shared_expert_gate"),
    (dict(num_experts=6), dict(ep=4), "model.moe.num_experts=6 is invalid: must be divisible by parallel.ep=4"),
    (dict(moe_ffn_hidden_size=10), dict(etp=4), "model.moe.moe_ffn_hidden_size=10 is invalid"),
])
def test_config_errors_are_one_line(kw, parallel, message):
    cfg = ModelConfig(hidden_size=H, layout="Ad Ae", moe=MoEConfig(**kw))
    with pytest.raises(ConfigError) as err:
        validate_model_parallel(cfg, ParallelConfig(**parallel))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_layout_using_e_needs_the_moe_section():
    with pytest.raises(ConfigError, match="model.moe is not set but model.layout uses 'e'"):
        ModelConfig(layout="Ad Ae").validate()


# ---- models and budgets ------------------------------------------------------------------

def test_dense_first_layers_and_active_budget():
    """'Ad (Ae)*2': the first layer dense, then MoE; a training step runs; only routed experts
    count fractionally towards the active budget."""
    from megamoe.core.config import AttentionConfig, MLPConfig
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.params import count_parameters
    from megamoe.model.weights import initialize

    moe = MoEConfig(num_experts=6, top_k=2, moe_ffn_hidden_size=8, num_shared_experts=1, aux_loss_coeff=0.01)
    cfg = ModelConfig(vocab_size=50, hidden_size=H, layout="Ad (Ae)*2", attention=AttentionConfig(num_heads=2),
                      mlp=MLPConfig(ffn_hidden_size=24), moe=moe)
    model = LanguageModel(cfg)
    initialize(model, model.groups, seed=0)
    assert [type(layer.mlp).__name__ for layer in model.layers.values()] == ["SwiGLUMLP", "MoELayer", "MoELayer"]
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=shift_labels(ids))
    loss.backward()
    assert torch.isfinite(loss) and model.layers["1"].mlp.router.weight.grad.abs().sum() > 0
    b = count_parameters(model)
    routed = 2 * 3 * 6 * H * 8
    assert b.total - b.active == pytest.approx(routed * (1 - 2 / 6))


def hand_count_moe_1t(m) -> tuple[int, float]:
    """(total, active) of a Kimi-K2-style recipe: MLA everywhere, dense 'd' and MoE 'e' MLPs."""
    h, a, e = m.hidden_size, m.mla, m.moe
    H, dn, dr, dv, rq, r = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.q_lora_rank, a.kv_lora_rank
    mla = h * rq + rq + rq * H * (dn + dr) + h * (r + dr) + r + r * H * (dn + dv) + H * dv * h
    dense = 3 * h * m.mlp.ffn_hidden_size
    routed = 3 * e.num_experts * h * e.moe_ffn_hidden_size
    moe_fixed = e.num_experts * h + e.num_experts + 3 * h * e.shared_ffn()  # router, expert bias, shared
    counts = m.parsed_layout().counts()
    layers = counts["M"] * (mla + 2 * h) + counts["d"] * dense + counts["e"] * (routed + moe_fixed)
    embed = 2 * m.vocab_size * h + h
    total = layers + embed
    active = total - counts["e"] * routed * (1 - e.top_k / e.num_experts)
    return total, active


def hand_count_hybrid_vl_1t(m) -> tuple[int, float]:
    """(total, active) of the hybrid VL preset: Gated DeltaNet 'G' and DSA 'D' mixers, dense
    'd' and MoE 'e' MLPs, a timm tower (its count from timm itself, built on meta)."""
    import timm

    h, g, a, e = m.hidden_size, m.gdn, m.mla, m.moe
    qk, v = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
    gdn = (h * (2 * qk + 2 * v + 2 * g.num_value_heads)     # in_proj: q | k | v | z | b | a
           + (2 * qk + v) * g.conv_kernel + 2 * g.num_value_heads + g.value_head_dim + v * h)
    H, dn, dr, dv, rq, r = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.q_lora_rank, a.kv_lora_rank
    mla = h * rq + rq + rq * H * (dn + dr) + h * (r + dr) + r + r * H * (dn + dv) + H * dv * h
    ix = a.indexer
    dsa = mla + rq * ix.num_heads * ix.head_dim + h * ix.head_dim + 2 * ix.head_dim + h * ix.num_heads
    dense = 3 * h * m.mlp.ffn_hidden_size
    routed = 3 * e.num_experts * h * e.moe_ffn_hidden_size
    moe_fixed = e.num_experts * h + e.num_experts + 3 * h * e.shared_ffn()
    counts = m.parsed_layout().counts()
    layers = (counts["G"] * gdn + counts["D"] * dsa + (counts["G"] + counts["D"]) * 2 * h
              + counts["d"] * dense + counts["e"] * (routed + moe_fixed))
    with torch.device("meta"):
        tower = timm.create_model(m.vision.encoder, pretrained=False, num_classes=0, **m.vision.encoder_args)
    total = layers + 2 * m.vocab_size * h + h + sum(p.numel() for p in tower.parameters())
    return total, total - counts["e"] * routed * (1 - e.top_k / e.num_experts)


def test_hybrid_vl_1t_preset_builds_on_meta_fast_and_small():
    """The seed's shape (3 of 4 mixers linear attention, the rest sparse MLA, 384 experts top-8,
    a timm tower) at 1T: a fresh process builds it on meta in < 30 s and < 2 GiB, and the
    counts equal the hand count."""
    from megamoe.recipe import load_recipe

    out = meta_budget("hybrid_vl_1t")
    recipe = load_recipe("hybrid_vl_1t")
    validate_model_parallel(recipe.model, recipe.parallel)
    counts = recipe.model.parsed_layout().counts()
    assert counts["G"] == 3 * counts["D"] and counts["e"] == 63
    total, active = hand_count_hybrid_vl_1t(recipe.model)
    assert out["total"] == total and total > 1.0e12
    assert out["active"] == pytest.approx(active, rel=1e-12)
    assert out["seconds"] < 30, out
    assert out["rss_mib"] < 2048, out


def test_1t_preset_builds_on_meta_fast_and_small():
    """A fresh process (so the RSS is the build's own): < 30 s, < 2 GiB, counts = hand count."""
    from megamoe.recipe import load_recipe

    out = meta_budget("moe_1t")
    recipe = load_recipe("moe_1t")
    validate_model_parallel(recipe.model, recipe.parallel)
    total, active = hand_count_moe_1t(recipe.model)
    assert out["total"] == total and total > 1.0e12
    assert out["active"] == pytest.approx(active, rel=1e-12) and 30e9 < active < 35e9
    assert out["seconds"] < 30, out
    assert out["rss_mib"] < 2048, out


def test_show_model_cli_reports_the_hand_count():
    """tools/show_model.py prints the 1T preset's layout and budget (built on meta) with the
    exact totals of the hand count."""
    from megamoe.recipe import load_recipe

    repo = Path(__file__).resolve().parent.parent
    t = time.time()
    out = subprocess.run([sys.executable, str(repo / "tools/show_model.py"), "--config", "moe_1t"], check=True,
                         capture_output=True, text=True, cwd=repo).stdout
    seconds = time.time() - t
    total, active = hand_count_moe_1t(load_recipe("moe_1t").model)
    assert f"total parameters: {total:,}  active per token: {round(active):,}" in out
    assert "layers.60     Me" in out and "summary: 1.03T total" in out
    assert seconds < 30


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("limit,alpha", [(None, None), (0.05, None), (0.05, 1.702)],
                         ids=["swiglu", "clamped", "oai"])  # 0.05: about half the pre-activations clamp
def test_fused_shared_expert_equals_the_modules(gate, limit, alpha):
    """On the CPU backend the one-rank shared expert runs fused with the routed output
    (``shared_swiglu_add``); it must give the modules' result (the local backend's shared
    expert, same weights and kernel): output and every gradient (shared gate included)."""
    fused = moe_layer("cpu", num_shared_experts=1, shared_expert_gate=gate, swiglu_limit=limit, swiglu_alpha=alpha,
                      expert_kernel="loop")
    assert fused.shared_experts.fuses(torch.zeros(1))
    plain = moe_layer("local", num_shared_experts=1, shared_expert_gate=gate, swiglu_limit=limit, swiglu_alpha=alpha,
                      expert_kernel="loop")
    plain.load_state_dict(fused.state_dict())
    assert not hasattr(plain.shared_experts, "fuses")
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(4))
    outs = []
    for layer in (fused, plain):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(dy)
        outs.append((y, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y1, dx1, g1), (y2, dx2, g2) = outs
    assert rel_err(y1, y2) <= 1e-6 and rel_err(dx1, dx2) <= 1e-6
    assert g1.keys() == g2.keys() and ("shared_gate" in g1) == gate
    for name in g1:
        assert rel_err(g1[name], g2[name]) <= 1e-6, name
