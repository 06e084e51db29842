"""Gated DeltaNet (G) and KDA (K) mixers: decoding, pieces, TP=2 == TP=1, budgets, hybrid stacks."""
from __future__ import annotations

import pytest
import torch

from megamoe.config import (AttentionConfig, GDNConfig, KDAConfig, MLPConfig, ModelConfig, ParallelConfig,
                            validate_model_parallel)
from megamoe.errors import ConfigError
from tests.numerics import rel_err

REL = 1e-5
HIDDEN = 32

# chunk_size 16 so that short sequences still cross chunk boundaries
KINDS = {
    "gdn": ("G", GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12, chunk_size=16)),
    "kda": ("K", KDAConfig(num_heads=2, head_dim=8, conv_kernel=3, chunk_size=16)),
    "kda_full_rank_safe_gate": ("K", KDAConfig(num_heads=2, head_dim=8, gate_rank=0, gate_lower_bound=-5.0,
                                               chunk_size=16)),
}


def make_mixer(kind: str, groups=None, sp: bool = False, seed: int = 0):
    import megamoe.layers  # noqa: F401
    from megamoe.layers.backend import LocalBackend
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.spec import BuildContext, build_module, mixer_spec
    from megamoe.weights import initialize

    letter, cfg = KINDS[kind]
    groups = groups or ParallelGroups()
    ctx = BuildContext(hidden_size=HIDDEN, groups=groups, backend=LocalBackend(), sequence_parallel=sp,
                       init_std=0.2)
    mixer = build_module(mixer_spec(letter), cfg, ctx, 3)
    initialize(mixer, groups, seed)
    return mixer


def info(x: torch.Tensor, cache=None, tp: int = 1):
    from megamoe.spec import ForwardInfo

    start = 0 if cache is None else cache.seen
    s = x.size(1) * tp
    return ForwardInfo(positions=torch.arange(start, start + s).expand(x.size(0), -1), cache=cache)


def random_x(b: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, s, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(KINDS))
def test_token_by_token_decoding_equals_full_forward(kind):
    from megamoe.cache import InferenceCache

    mixer = make_mixer(kind)
    x = random_x(2, 21)
    with torch.no_grad():
        full = mixer(x, info(x))
        cache, outs = InferenceCache(2), []
        for t in range(x.size(1)):
            outs.append(mixer(x[:, t:t + 1], info(x[:, t:t + 1], cache)))
            cache.advance(1)
    assert rel_err(torch.cat(outs, 1), full) <= REL
    state = cache.layer(3)
    assert state["recurrent"].dtype == torch.float32 and state["conv"].size(1) == KINDS[kind][1].conv_kernel - 1


@pytest.mark.parametrize("kind", list(KINDS))
def test_pieces_with_state_carried_equal_one_pass(kind):
    from megamoe.cache import InferenceCache

    mixer = make_mixer(kind)
    x = random_x(2, 40)
    full = mixer(x, info(x))
    cache, outs = InferenceCache(2), []
    for lo, hi in ((0, 2), (2, 19), (19, 20), (20, 40)):  # conv window longer than a piece, too
        outs.append(mixer(x[:, lo:hi], info(x[:, lo:hi], cache)))
        cache.advance(hi - lo)
    assert rel_err(torch.cat(outs, 1), full) <= REL


def tp_mixer_case(kind: str, sp: bool, seed: int = 0) -> dict:
    """One rank of a TP=2 mixer vs a TP=1 mixer with the same weights: output, input and
    parameter gradients (gathered to full tensors)."""
    from megamoe.parallel import comm
    from megamoe.parallel.groups import ParallelGroups, build_groups
    from megamoe.parallel.sharding import gather_full
    from megamoe.weights import finalize_grads

    groups = build_groups(ParallelConfig(tp=2, sequence_parallel=sp))
    ref = make_mixer(kind, ParallelGroups(), seed=seed)
    model = make_mixer(kind, groups, sp, seed=seed)
    x = random_x(2, 24, seed=seed + 1)
    w = random_x(2, 24, seed=seed + 2)
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref, info(x))
    (y_ref * w).sum().backward()
    rank = groups.tp_rank
    x_local = (x.chunk(2, 1)[rank] if sp else x).clone().requires_grad_(True)
    y = model(x_local, info(x_local, tp=2 if sp else 1))
    (y * (w.chunk(2, 1)[rank] if sp else w)).sum().backward()
    finalize_grads(model, groups)
    y_full = comm.all_gather_tensor(y, 1, groups.tp) if sp else y
    grad_x_ref = x_ref.grad.chunk(2, 1)[rank] if sp else x_ref.grad
    errs = {"output": rel_err(y_full, y_ref), "grad x": rel_err(x_local.grad, grad_x_ref)}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        errs[f"grad {name}"] = rel_err(gather_full(p, groups, p.grad), ref_params[name].grad)
    return errs


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_tp2_equals_tp1(pool, kind, sp):
    results = pool(2).run(tp_mixer_case, kind, sp)
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"
    assert len(results[0]) >= 8  # output, input and every parameter gradient compared


def expected_budget(kind: str) -> int:
    """The per-layer formulas of docs/mixers.md."""
    _, c = KINDS[kind]
    h = HIDDEN
    if kind == "gdn":
        kd, vd, hv = c.num_key_heads * c.key_head_dim, c.num_value_heads * c.value_head_dim, c.num_value_heads
        return h * (2 * kd + 2 * vd + 2 * hv) + (2 * kd + vd) * c.conv_kernel + 2 * hv + c.value_head_dim + vd * h
    W, H, r = c.num_heads * c.head_dim, c.num_heads, c.rank()
    gates = 2 * (h * r + r * W) if r else 2 * h * W
    return h * (3 * W + H) + 3 * W * c.conv_kernel + gates + H + W + c.head_dim + W * h


@pytest.mark.parametrize("kind", list(KINDS))
def test_parameter_budget_formula(kind):
    mixer = make_mixer(kind)
    assert sum(p.numel() for p in mixer.parameters()) == expected_budget(kind)


def hybrid_config(layout: str = "GdGdKdAd") -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=HIDDEN, layout=layout,
                       attention=AttentionConfig(num_heads=4, num_kv_heads=2, qk_norm=True, output_gate=True),
                       mlp=MLPConfig(ffn_hidden_size=48), gdn=KINDS["gdn"][1], kda=KINDS["kda"][1],
                       norm_zero_centered=True)


def test_hybrid_stack_builds_trains_and_decodes():
    from megamoe.cache import InferenceCache
    from megamoe.model import LanguageModel, shift_labels
    from megamoe.params import count_parameters
    from megamoe.plan import budget, describe
    from megamoe.weights import initialize

    cfg = hybrid_config()
    model = LanguageModel(cfg)
    initialize(model, model.groups, 0)
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=shift_labels(ids))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        full = model(ids)
        cache = InferenceCache(2)
        steps = [model(ids[:, :7], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(7, 19)]
    assert rel_err(torch.cat(steps, 1), full) <= REL
    text = describe(cfg)
    assert "G=gated DeltaNet x2" in text and "K=Kimi delta attention (KDA) x1" in text
    total = count_parameters(model).total
    assert budget(cfg).total == total and f"total parameters: {total:,}" in text
    assert count_parameters(model).parts["layers.0"][0] - count_parameters(model).parts["layers.3"][0] != 0


def test_tiny_hybrid_recipe_plans():
    from megamoe.plan import describe
    from megamoe.recipe import load_recipe

    r = load_recipe("tiny_hybrid")
    validate_model_parallel(r.model, r.parallel)
    assert "G=gated DeltaNet" in describe(r.model) and "K=Kimi delta attention" in describe(r.model)


@pytest.mark.parametrize("section,field,value,match", [
    ("gdn", "num_value_heads", 3, "model.gdn.num_value_heads=3 is invalid: must be a multiple of num_key_heads"),
    ("gdn", "chunk_size", 24, "model.gdn.chunk_size=24 is invalid"),
    ("kda", "gate_lower_bound", 2.0, "model.kda.gate_lower_bound=2.0 is invalid: must be < 0"),
    ("kda", "gate_rank", -1, "model.kda.gate_rank=-1 is invalid"),
])
def test_config_errors_name_the_field(section, field, value, match):
    import dataclasses

    cfg = hybrid_config()
    setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **{field: value}))
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_parallel_errors_name_the_field():
    with pytest.raises(ConfigError, match="model.gdn.num_key_heads=2 is invalid: must be divisible by parallel.tp=4"):
        validate_model_parallel(hybrid_config("GdGd"), ParallelConfig(tp=4))
    with pytest.raises(ConfigError, match="model.kda.num_heads=2 is invalid"):
        validate_model_parallel(hybrid_config("KdKd"), ParallelConfig(tp=4))
    with pytest.raises(ConfigError, match="model.gdn is not set"):
        validate_model_parallel(ModelConfig(layout="GdAd"), ParallelConfig())
