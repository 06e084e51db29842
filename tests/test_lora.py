"""LoRA on one process: merge/unmerge, decoding with adapters, the expert maths against a merged
reference (forward and backward), target selection, freezing and config errors; on every
backend the CPU runs (``tests/backend_utils.py``: local, cpu, the cuda backend's roles on CPU
tensors, its FP8 roles too), the adapters wrapping whatever roles the backend returned, and
each backend's adapted model against the local backend's."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megamoe.core.errors import ConfigError
from tests.backend_utils import CPU_BACKENDS, cuda_on_cpu_registered
from tests.lora_utils import build_lora_model, lora_model_config, token_batches
from tests.numerics import rel_err

REL = 1e-5
per_backend = pytest.mark.parametrize("backend", CPU_BACKENDS)


@pytest.fixture(autouse=True, scope="module")
def _cuda_on_cpu():
    with cuda_on_cpu_registered():
        yield


@per_backend
def test_adapted_model_matches_the_local_backend(backend):
    """Adapters on whatever roles a backend returned: logits, the loss's gradient of every
    adapter factor and of the input embedding, against the same adapted model on ``local``."""
    from megamoe.lora import lora_parameters

    ids = token_batches(1, 2, 13, 61)[0]
    runs = []
    for name in (backend, "local"):
        model = build_lora_model(lora_model_config(backend=name))
        assert model.ctx.backend.name == name
        logits = model(ids)
        logits.square().mean().backward()
        # the DSA indexers' adapters get no gradient from the loss (the indexer is not trained through it)
        runs.append([logits.detach()] + [p.grad for n, p in sorted(lora_parameters(model)) if ".indexer." not in n])
    assert len(runs[0]) > 40 and all(g is not None and g.abs().sum() > 0 for g in runs[0][1:])
    for a, b in zip(*runs):
        assert rel_err(a, b) <= REL


@per_backend
def test_merged_model_equals_adapter_model_and_unmerge_restores(backend):
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.lora import merge, unmerge
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize

    cfg = lora_model_config(backend=backend)
    ids = token_batches(1, 2, 10, cfg.vocab_size)[0]
    base = LanguageModel(cfg)
    initialize(base, base.groups, 0)
    model = build_lora_model(cfg).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    with torch.no_grad():
        base_logits, logits = base.eval()(ids), model(ids)
        assert rel_err(logits, base_logits) > 1e-2  # the adapters do change the model
        cache = InferenceCache(2)  # MLA decodes in the absorbed form: W_uk/W_uv with the adapter folded in
        steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(4, 10)]
        assert rel_err(torch.cat(steps, dim=1), logits) <= REL
        merge(model)
        assert rel_err(model(ids), logits) <= REL
        unmerge(model)
        assert rel_err(model(ids), logits) <= REL
    for n, p in model.named_parameters():
        if n in before:
            assert rel_err(p, before[n]) <= 1e-6, n


def test_adapted_model_copies_and_moves():
    """The adapters follow the model: a deep copy is independent (its adapters wrap its own roles)
    and a dtype move (what ``megamoe.diagnostics.precision.cast`` does) computes the same function."""
    import copy

    from megamoe.lora import lora_parameters

    model = build_lora_model(lora_model_config("GeMe")).eval()
    ids = token_batches(1, 2, 9, 61)[0]
    with torch.no_grad():
        logits = model(ids)
        twin = copy.deepcopy(model).to(torch.float64)
        assert rel_err(twin(ids).float(), logits) <= 1e-5
        for _, p in lora_parameters(twin):
            p.zero_()
        assert rel_err(model(ids), logits) == 0  # the original's adapters are untouched
        assert rel_err(twin(ids).float(), logits) > 1e-3  # and the copy's own adapters are the ones it runs


@pytest.mark.parametrize("shared", [False, True], ids=["per_expert", "shared"])
@pytest.mark.parametrize("kernel", ["loop", "reference", "grouped_mm"])
@pytest.mark.parametrize("glu", [(0.8,), (None,), (0.8, 1.702, 1.0)], ids=["limit", "nolimit", "oai"])
def test_expert_adapters_match_merged_weights_reference(shared, kernel, glu):
    """The grouped low-rank maths in the form of each base kernel (the loop kernel's hand-written
    backward, per-expert and grouped GEMMs under autograd) == the reference kernel on W + s B A,
    outputs and gradients (x, the four factors, the routing probs and, unfrozen, the weights)."""
    from megamoe.layers.ops.grouped_gemm import swiglu_experts_reference
    from megamoe.layers.mlp.dense import GLU
    from megamoe.lora.experts import ExpertLoRA, lora_swiglu_experts, merged_weights

    glu = GLU(*glu)

    gen = torch.Generator().manual_seed(0)
    e, h, f, r, n = 3, 12, 12, 4, 9  # rows of 16-byte multiples: grouped_mm takes every GEMM

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 0.3).requires_grad_(True)

    lead = () if shared else (e,)
    x, w1, w2 = rnd(n, h), rnd(e, 2 * f, h), rnd(e, h, f)
    factors = [rnd(*lead, r, h), rnd(*lead, 2 * f, r), rnd(*lead, r, f), rnd(*lead, h, r)]
    counts = [5, 0, 8]  # an expert without rows
    idx = torch.randint(0, n, (13,), generator=gen)
    probs = torch.rand(13, generator=gen).requires_grad_(True)
    grad_out = torch.randn(n, h, generator=gen)
    lora = ExpertLoRA(*factors, scale=1.5)

    out = lora_swiglu_experts(kernel, x, idx, counts, probs, w1.detach(), w2.detach(), lora, n, glu=glu)
    got = torch.autograd.grad((out * grad_out).sum(), [x, probs, *factors])
    m1, m2 = merged_weights(w1.detach(), w2.detach(), lora)
    ref = swiglu_experts_reference(x, idx, counts, probs, m1, m2, n, glu=glu)
    want = torch.autograd.grad((ref * grad_out).sum(), [x, probs, *factors])
    assert rel_err(out, ref) <= REL
    for name, a, b in zip(["x", "probs", "A1", "B1", "A2", "B2"], got, want):
        assert b.abs().sum() > 0 and rel_err(a, b) <= REL, name
    # unfrozen base weights: their gradients too
    out = lora_swiglu_experts(kernel, x, idx, counts, probs, w1, w2, lora, n, glu=glu)
    got = torch.autograd.grad((out * grad_out).sum(), [w1, w2])
    ref = swiglu_experts_reference(x, idx, counts, probs, w1 + (m1 - w1).detach(), w2 + (m2 - w2).detach(), n,
                                   glu=glu)
    want = torch.autograd.grad((ref * grad_out).sum(), [w1, w2])
    for name, a, b in zip(["W1", "W2"], got, want):
        assert rel_err(a, b) <= REL, name


@per_backend
def test_adapter_dropout_trains_stochastically_and_evaluates_exactly(backend):
    """dropout > 0: in training two passes differ and adapters (experts' included, through the
    autograd expert path) get gradients; in eval the model equals the same adapters without dropout."""
    from megamoe.lora import lora_parameters

    cfg = lora_model_config("GeAe", backend=backend)
    ids = token_batches(1, 2, 10, cfg.vocab_size)[0]
    plain = build_lora_model(cfg).eval()
    dropped = build_lora_model(cfg, dropout=0.5)
    torch.manual_seed(0)
    a, b = dropped(ids), dropped(ids)
    assert rel_err(a, b) > 1e-3
    a.square().mean().backward()
    grads = {n: p.grad for n, p in lora_parameters(dropped)}
    assert all(g is not None for g in grads.values())
    assert grads["layers.0.mlp.experts.gate_up_lora_A"].abs().sum() > 0
    with torch.no_grad():
        assert rel_err(dropped.eval()(ids), plain(ids)) <= REL


@per_backend
def test_targets_freezing_and_names(backend):
    from megamoe.lora import LoRAConfig, apply_lora, lora_parameters
    from megamoe.lora.adapters import has_lora
    from megamoe.lora.api import adaptable_modules
    from megamoe.model.language_model import LanguageModel

    cfg = lora_model_config("GeAd", backend=backend)
    model = apply_lora(LanguageModel(cfg), LoRAConfig(rank=2))
    mods = adaptable_modules(model)
    assert all(has_lora(m) for m in mods.values()) and "layers.0.mlp.experts" in mods
    assert "layers.0.mlp.shared_experts.linear_fc1" in mods and "layers.0.mixer.in_proj" in mods
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora_parameters(model)}
    assert "layers.0.mixer.in_proj.lora_A" in trainable and "layers.0.mlp.experts.down_lora_B" in trainable
    router = model.layers["0"].mlp.router
    assert not router.weight.requires_grad and not router.expert_bias.requires_grad

    only = apply_lora(LanguageModel(cfg), LoRAConfig(targets=["experts", "layers.1"], exclude=["linear_fc2"]))
    chosen = sorted(n for n, m in adaptable_modules(only).items() if has_lora(m))
    assert chosen == ["layers.0.mlp.experts", "layers.1.mixer.linear_proj", "layers.1.mixer.linear_qkv",
                      "layers.1.mlp.linear_fc1"]
    for pattern in ("nothing_here", "router"):
        with pytest.raises(ConfigError) as err:
            apply_lora(LanguageModel(cfg), LoRAConfig(targets=["*", pattern]))
        assert "\n" not in str(err.value) and "lora.targets" in str(err.value) and pattern in str(err.value)
    with pytest.raises(ConfigError, match="already applied"):
        apply_lora(only)


@pytest.mark.parametrize("field,value", [("rank", 0), ("alpha", -1.0), ("dropout", 1.0),
                                         ("expert_adapters", "per_rank")])
def test_config_errors_name_the_field(field, value):
    from megamoe.lora import LoRAConfig

    with pytest.raises(ConfigError, match=f"lora.{field}"):
        LoRAConfig(**{field: value}).validate()


# ---- adapters around FP8 roles; recomputation -------------------------------------------------

@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
def test_adapters_wrap_fp8_linear_roles(kind):
    """train.fp8=torch: the adapter adds exactly ``s B A x`` to whatever the FP8 role computes (its
    FP8 GEMM stays), the factors get their exact gradients (which do not involve the base GEMM),
    and merging folds the update into the weight the FP8 GEMM then reads."""
    import torch.nn.functional as F

    from megamoe.layers.ops.fp8.linear import fp8_linear
    from megamoe.lora import LoRAConfig
    from megamoe.lora.adapters import attach
    from megamoe.parallel.groups import ParallelGroups
    from tests.backend_utils import ctx_for

    ctx = ctx_for("cuda_on_cpu", fp8="torch")
    role = {"column": lambda: ctx.backend.column_linear(ctx, 32, [16, 16], bias=True),
            "row": lambda: ctx.backend.row_linear(ctx, 32, 16, bias=True),
            "replicated": lambda: ctx.backend.replicated_linear(ctx, 16, 32)}[kind]()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in role.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(2, 5, role.weight.size(1), generator=gen)
    dy = torch.randn(2, 5, role.weight.size(0), generator=gen)
    base = role(x).detach()
    bias = 0 if role.bias is None else role.bias.detach()
    assert rel_err(base, F.linear(x, role.weight.detach()) + bias) > 1e-4  # the FP8 GEMM does run

    adapter = attach(role, LoRAConfig(rank=3, alpha=6.0), ParallelGroups())
    with torch.no_grad():
        role.lora_A.normal_(0, 0.3, generator=gen)
        role.lora_B.normal_(0, 0.3, generator=gen)
    a, b = (t.detach().clone().requires_grad_() for t in (role.lora_A, role.lora_B))
    low = F.linear(F.linear(x, a), b) * adapter.scale
    y = role(x)
    assert rel_err(y.detach() - base, low.detach()) <= 1e-5
    got = torch.autograd.grad(y, [role.lora_A, role.lora_B], dy)
    want = torch.autograd.grad(low, [a, b], dy)
    for name, g, w in zip("AB", got, want):
        assert rel_err(g, w) <= 1e-6, name

    w0 = role.weight.detach().clone()
    merged = w0 + (b.detach() @ a.detach()) * adapter.scale
    with torch.no_grad():
        adapter.merge()
        local_bias = None if kind == "row" else role.bias  # a row-parallel bias is added after the reduction
        assert torch.equal(role(x), fp8_linear(x, merged, local_bias) + (bias if local_bias is None else 0))
        adapter.unmerge()
    assert rel_err(role.weight, w0) <= 1e-6


def test_fp8_model_carries_adapters_on_every_role():
    """With FP8 roles LoRA targets the same modules as on local (FP8 roles were once skipped),
    and the adapted FP8 model stays near the local one (e4m3 rounding through the layers)."""
    from megamoe.lora import lora_parameters

    ids = token_batches(1, 2, 13, 61)[0]
    runs, names = [], []
    for name, fp8 in (("cuda_on_cpu", "torch"), ("local", None)):
        model = build_lora_model(lora_model_config(backend=name), fp8=fp8)
        logits = model(ids)
        logits.square().mean().backward()
        params = dict(lora_parameters(model))
        names.append(sorted(params))
        runs.append((logits.detach(), [params[n].grad for n in sorted(params) if ".indexer." not in n]))
    assert names[0] == names[1] and len(names[0]) > 100
    assert rel_err(*(r[0] for r in runs)) < 0.1
    assert all(g is not None and g.abs().sum() > 0 for g in runs[0][1])


def test_recompute_gives_the_same_adapter_gradients():
    """Recomputed layers rebuild the adapters' activations, adapter dropout masks included:
    every adapter gradient as without recomputation."""
    from megamoe.lora import lora_parameters

    ids = token_batches(1, 2, 11, 61)[0]
    grads = []
    for parts in ([], ["layer"]):
        model = build_lora_model(lora_model_config("AeMd"), dropout=0.3)
        model.set_recompute(parts)
        torch.manual_seed(0)
        model(ids).square().mean().backward()
        grads.append([p.grad for _, p in lora_parameters(model)])
    assert len(grads[0]) > 20
    for a, b in zip(*grads):
        assert rel_err(a, b) <= 1e-6


# no class swap, no role class, backend name or device test: LoRA knows roles by their interface
NOT_IN_LORA = re.compile(r"__class__|\btype\(|Backend\b|[\"'](local|cpu|te|cuda)[\"']|\.device\.type|\.is_cuda|"
                         r"torch\.cuda|ParallelLinear|ReplicatedLinear|GroupedExperts|SharedExpert|layers\.backends")


def test_lora_wraps_roles_without_knowing_backends():
    files = sorted(Path(__file__).resolve().parents[1].joinpath("megamoe", "lora").glob("*.py"))
    assert len(files) >= 5
    hits = [f"{p.name}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if NOT_IN_LORA.search(line)]
    assert hits == []
