"""Gated DeltaNet (G) and KDA (K) mixers: decoding, pieces, TP=2 == TP=1, budgets, hybrid stacks.

Configs come from ``tests.mixer_utils.tiny_model`` (chunks of 8 tokens, so short sequences
cross chunk boundaries); ``VARIANTS`` adds KDA with full-rank gates and the safe gate.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.core.config import ParallelConfig, validate_model_parallel
from megamoe.core.errors import ConfigError
from tests.mixer_utils import build_mixer, decode_steps, full_forward, mixer_tp_case, tiny_model
from tests.numerics import rel_err

REL = 1e-5


def variant(name: str) -> tuple[str, dict]:
    """(letter, ModelConfig sections replacing tiny_model's)."""
    base = tiny_model()
    return {
        "gdn": ("G", {}),
        "kda": ("K", {}),
        "kda_full_rank_safe_gate": ("K", {"kda": dataclasses.replace(base.kda, gate_rank=0, gate_lower_bound=-5.0)}),
    }[name]


VARIANTS = ["gdn", "kda", "kda_full_rank_safe_gate"]


def mixer_of(name: str, **kw):
    letter, sections = variant(name)
    cfg = tiny_model(f"{letter}d", **sections)
    return build_mixer(letter, cfg, **kw), getattr(cfg, "gdn" if letter == "G" else "kda")


def random_x(b: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, s, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", VARIANTS)
def test_token_by_token_decoding_equals_full_forward(name):
    mixer, _ = mixer_of(name)
    x = random_x(2, 21)
    with torch.no_grad():
        full = full_forward(mixer, x)
        assert rel_err(decode_steps(mixer, x), full) <= REL
        assert rel_err(decode_steps(mixer, x, prefill=11), full) <= REL


def reference_ops(mixer) -> None:
    """Swap the mixer's fast roles for their slow twins: the naive recurrence for the chunked
    delta rule, torch's conv1d for the fused causal conv + SiLU, the L2 norm formula."""
    import torch.nn.functional as F

    from megamoe.layers.ops.l2norm import l2norm_reference
    from megamoe.layers.ops.delta_rule.naive import naive_delta_rule

    class Naive:
        def chunked(self, q, k, v, g, beta, *, scale=None, initial_state=None, **_):
            return naive_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def conv(x, weight, state=None):
        assert state is None
        full = F.pad(x, (0, 0, weight.size(-1) - 1, 0)).transpose(1, 2)
        y = F.silu(F.conv1d(full, weight.unsqueeze(1), groups=x.size(-1))).transpose(1, 2)
        return y, None

    mixer.op, mixer.conv, mixer.l2norm = Naive(), conv, l2norm_reference


@pytest.mark.parametrize("name", VARIANTS)
def test_mixer_forward_and_param_grads_match_naive_reference(name):
    """The whole mixer on its fast ops (chunked delta rule across chunk boundaries, fused conv)
    against the same mixer on the naive recurrence and torch's conv1d: output, input gradient
    and every parameter gradient, fp32, rel <= 1e-5."""
    mixer, _ = mixer_of(name)
    params = list(mixer.parameters())
    x = random_x(2, 21, seed=3).requires_grad_(True)
    out = full_forward(mixer, x)
    got = torch.autograd.grad(out.square().sum(), [x, *params])
    reference_ops(mixer)
    ref = full_forward(mixer, x)
    want = torch.autograd.grad(ref.square().sum(), [x, *params])
    assert rel_err(out, ref) <= REL
    assert len(want) == len(params) + 1 and all(w.abs().sum() > 0 for w in want)
    for (pname, _), a, b in zip([("x", None), *mixer.named_parameters()], got, want):
        assert rel_err(a, b) <= REL, pname


@pytest.mark.parametrize("name", VARIANTS)
def test_pieces_with_state_carried_equal_one_pass(name):
    """Pieces shorter than the conv window and longer than a chunk, with gradients."""
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.layers.spec import ForwardInfo

    mixer, cfg = mixer_of(name)
    x = random_x(2, 40)
    x_full, x_pieces = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    full = full_forward(mixer, x_full)
    cache, outs = InferenceCache(2), []
    for lo, hi in ((0, 2), (2, 19), (19, 20), (20, 40)):
        outs.append(mixer(x_pieces[:, lo:hi], ForwardInfo(positions=cache.positions(hi - lo), cache=cache)))
        cache.advance(hi - lo)
    pieces = torch.cat(outs, 1)
    assert rel_err(pieces, full) <= REL
    w = random_x(2, 40, seed=2)
    (full * w).sum().backward()
    (pieces * w).sum().backward()
    assert rel_err(x_pieces.grad, x_full.grad) <= REL
    state = cache.layer(1)
    assert state["recurrent"].dtype == torch.float32 and state["conv"].size(1) == cfg.conv_kernel - 1


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("name", VARIANTS)
def test_tp2_equals_tp1(pool, name, sp):
    letter, sections = variant(name)
    results = pool(2).run(mixer_tp_case, letter, sp, model=sections)
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"
    n_params = len(list(mixer_of(name)[0].parameters()))
    assert sum(k.startswith("grad ") for k in results[0]) == n_params + 1  # x and every parameter


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_hybrid_linear_model_tp2_equals_tp1(pool, sp):
    """A whole LM with G, K and A layers: logits, loss and all gradients after finalize_grads."""
    from tests.test_tensor_parallel import tp_parity_case

    for rank, errs in enumerate(pool(2).run(tp_parity_case, tiny_model("GdKdAd", tie_embeddings=True), 2, sp)):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"


def expected_budget(name: str) -> int:
    """The per-layer formulas of docs/mixers.md."""
    letter, sections = variant(name)
    cfg = tiny_model(**sections)
    h = cfg.hidden_size
    if letter == "G":
        c = cfg.gdn
        kd, vd, hv = c.num_key_heads * c.key_head_dim, c.num_value_heads * c.value_head_dim, c.num_value_heads
        return h * (2 * kd + 2 * vd + 2 * hv) + (2 * kd + vd) * c.conv_kernel + 2 * hv + c.value_head_dim + vd * h
    c = cfg.kda
    W, H, r = c.num_heads * c.head_dim, c.num_heads, c.rank()
    gates = 2 * (h * r + r * W) if r else 2 * h * W
    return h * (3 * W + H) + 3 * W * c.conv_kernel + gates + H + W + c.head_dim + W * h


@pytest.mark.parametrize("name", VARIANTS)
def test_parameter_budget_formula(name):
    from megamoe.planning.plan import budget

    letter, sections = variant(name)
    cfg = tiny_model(f"{letter}n", **sections)
    assert budget(cfg).parts["layers.0"][0] - cfg.hidden_size == expected_budget(name)  # minus the input norm


def test_hybrid_stack_trains_and_decodes():
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.params import count_parameters
    from megamoe.planning.plan import budget, describe
    from megamoe.model.weights import initialize

    cfg = tiny_model("GdGdKdAd")
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


@pytest.mark.parametrize("parts", [["core"], ["mixer", "mlp"], ["layer", "core"]])
def test_selective_recompute_gives_the_same_loss_and_gradients(parts):
    """train.recompute: what is recomputed changes memory, not numbers (fp32, bitwise)."""
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.weights import initialize

    cfg = tiny_model("GdKdAd")
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    results = []
    for recompute in ([], parts):
        model = LanguageModel(cfg)
        initialize(model, model.groups, 0)
        model.set_recompute(recompute)
        loss = model(ids, labels=shift_labels(ids))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert [m.mixer.recompute_core for m in list(model.layers.values())[:2]] == ["core" in parts] * 2
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


def test_tiny_hybrid_recipe_plans():
    from megamoe.planning.plan import describe
    from megamoe.recipe import load_recipe

    r = load_recipe("tiny_hybrid")
    validate_model_parallel(r.model, r.parallel)
    assert "G=gated DeltaNet" in describe(r.model) and "K=Kimi delta attention" in describe(r.model)


@pytest.mark.parametrize("section,field,value,match", [
    ("gdn", "num_value_heads", 3, "model.gdn.num_value_heads=3 is invalid: must be a multiple of num_key_heads"),
    ("gdn", "chunk_size", 24, "model.gdn.chunk_size=24 is invalid: must be a power of two"),
    ("kda", "gate_lower_bound", 2.0, "model.kda.gate_lower_bound=2.0 is invalid: must be < 0"),
    ("kda", "gate_rank", -1, "model.kda.gate_rank=-1 is invalid"),
])
def test_config_errors_name_the_field(section, field, value, match):
    cfg = tiny_model("GdKd")
    setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **{field: value}))
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_parallel_errors_name_the_field():
    with pytest.raises(ConfigError, match="model.gdn.num_key_heads=2 is invalid: must be divisible by parallel.tp=4"):
        validate_model_parallel(tiny_model("GdGd"), ParallelConfig(tp=4))
    with pytest.raises(ConfigError, match="model.kda.num_heads=2 is invalid"):
        validate_model_parallel(tiny_model("KdKd"), ParallelConfig(tp=4))
    with pytest.raises(ConfigError, match="model.gdn is not set"):
        validate_model_parallel(tiny_model("GdAd", gdn=None), ParallelConfig())
