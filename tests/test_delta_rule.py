"""The gated delta rule ops: chunked == recurrent == naive, forward and gradients, in fp32.

Per-head decay (Gated DeltaNet) and per-channel decay (KDA), with more value heads than key
heads, at awkward lengths and with an initial state; pieces with the state carried; strong
decays; fla never imported on CPU.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from megamoe.layers.ops.delta_rule.chunk import chunk_delta_rule
from megamoe.layers.ops.delta_rule.naive import naive_delta_rule, recurrent_delta_rule
from tests.numerics import rel_err

REL = 1e-5


def make_inputs(t: int, per_channel: bool, seed: int = 0, b: int = 2, hk: int = 1, hv: int = 2, dk: int = 16,
                dv: int = 8, decay_scale: float = 1.0):
    """q, k unit-norm per head (as the mixers feed them), g <= 0, beta in (0, 1), a random h0."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, hk, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, t, hk, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g_shape = (b, t, hv, dk) if per_channel else (b, t, hv)
    g = F.logsigmoid(torch.randn(g_shape, generator=gen) + 1.0) * decay_scale
    beta = torch.rand(b, t, hv, generator=gen)
    h0 = torch.randn(b, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, h0


def run_with_grads(fn, inputs, use_h0: bool, **kw):
    """Output, final state and the gradients of a fixed random projection of both."""
    xs = [x.clone().requires_grad_(True) for x in inputs]
    o, state = fn(*xs[:5], initial_state=xs[5] if use_h0 else None, **kw)
    gen = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    loss.backward()
    names = ["q", "k", "v", "g", "beta", "h0"][: 6 if use_h0 else 5]
    return o.detach(), state.detach(), {n: x.grad for n, x in zip(names, xs)}


def compare(got, ref) -> dict:
    errs = {"o": rel_err(got[0], ref[0]), "state": rel_err(got[1], ref[1])}
    errs.update({f"d{n}": rel_err(got[2][n], ref[2][n]) for n in ref[2]})
    return errs


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("t,use_h0", [(1, True), (63, False), (63, True), (64, True), (65, True), (500, True)])
def test_chunked_and_recurrent_match_naive(per_channel, t, use_h0):
    inputs = make_inputs(t, per_channel, seed=t)
    ref = run_with_grads(naive_delta_rule, inputs, use_h0)
    for name, fn in (("recurrent", recurrent_delta_rule), ("chunked", chunk_delta_rule)):
        errs = compare(run_with_grads(fn, inputs, use_h0), ref)
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"{name} vs naive, t={t}: relative errors over {REL}: {bad}"


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_recompute_gives_the_same_values_and_gradients(per_channel):
    """recompute=True (train.recompute=[core]) keeps only the inputs and rebuilds the chunk
    matrices in backward: bitwise the same forward and backward as keeping them."""
    inputs = make_inputs(130, per_channel, seed=7)
    kept = run_with_grads(chunk_delta_rule, inputs, True, chunk_size=32)
    rebuilt = run_with_grads(chunk_delta_rule, inputs, True, chunk_size=32, recompute=True)
    assert torch.equal(kept[0], rebuilt[0]) and torch.equal(kept[1], rebuilt[1])
    for name in kept[2]:
        assert torch.equal(kept[2][name], rebuilt[2][name]), name


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_chunk_size_does_not_change_result(per_channel):
    inputs = make_inputs(100, per_channel, seed=5)
    a, sa = chunk_delta_rule(*inputs[:5], initial_state=inputs[5], chunk_size=16)
    b, sb = chunk_delta_rule(*inputs[:5], initial_state=inputs[5], chunk_size=64)
    assert rel_err(a, b) <= REL and rel_err(sa, sb) <= REL


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_pieces_with_state_carried_equal_one_pass(per_channel):
    q, k, v, g, beta, h0 = make_inputs(150, per_channel, seed=7)
    full, full_state = chunk_delta_rule(q, k, v, g, beta, initial_state=h0)
    state, outs = h0, []
    for lo, hi in ((0, 37), (37, 101), (101, 150)):
        piece = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        o, state = chunk_delta_rule(*piece, initial_state=state)
        outs.append(o)
    assert rel_err(torch.cat(outs, 1), full) <= REL
    assert rel_err(state, full_state) <= REL


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_strong_decay_stays_finite_and_exact(per_channel):
    """Decays of -5 per step (glm5_next's gate bound) make exp(-G) overflow across a chunk;
    every product in the chunked form keeps a non-positive exponent, so nothing does."""
    inputs = list(make_inputs(130, per_channel, seed=3))
    inputs[3] = torch.full_like(inputs[3], -5.0)
    inputs[3][:, ::7] = -0.01  # mixed with slow channels / steps
    ref = run_with_grads(naive_delta_rule, inputs, True)
    got = run_with_grads(chunk_delta_rule, inputs, True)
    assert all(torch.isfinite(x).all() for x in (got[0], got[1], *got[2].values()))
    errs = compare(got, ref)
    assert max(errs.values()) <= REL, errs


def test_bad_initial_state_shape_names_it():
    q, k, v, g, beta, h0 = make_inputs(4, False)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_delta_rule(q, k, v, g, beta, initial_state=h0[:, :1])


def test_fla_never_imported_on_cpu(tmp_path, monkeypatch):
    """With an importable (booby-trapped) fla on the path, the cuda backend's ops on CPU tensors
    run the torch forms and never import it."""
    import importlib.util

    from megamoe.layers.backends.cuda import CudaBackend

    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("raise ImportError('fla must not be imported on CPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("fla") is not None  # the trap is visible
    backend = CudaBackend()
    op, lightning = backend.delta_rule(None), backend.lightning(None)
    q, k, v, g, beta, _ = make_inputs(5, True)
    ref, _ = chunk_delta_rule(q, k, v, g, beta)
    got, _ = op.chunked(q, k, v, g, beta)
    op.recurrent(q, k, v, g, beta)
    lightning.chunked(q, k, q, torch.full((q.size(2),), 0.1))
    lightning.recurrent(q, k, q, torch.full((q.size(2),), 0.1))
    assert "fla" not in sys.modules
    assert rel_err(got, ref) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_fla_matches_chunked_on_cuda(per_channel):
    """The cuda backend's chunked op (fla) from a given state against the torch op."""
    from megamoe.layers.backends.cuda import CudaBackend, fla_installed

    if not fla_installed():
        pytest.skip("fla is not installed")
    inputs = [x.cuda() for x in make_inputs(200, per_channel, seed=11)]
    ref, ref_state = chunk_delta_rule(*inputs[:5], initial_state=inputs[5])
    got, state = CudaBackend().delta_rule(None).chunked(*inputs[:5], initial_state=inputs[5])
    assert rel_err(got, ref) <= 1e-3 and rel_err(state, ref_state) <= 1e-3


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_bf16_inputs_keep_an_fp32_state(per_channel):
    inputs = make_inputs(70, per_channel, seed=13)
    ref, ref_state = naive_delta_rule(*inputs[:5], initial_state=inputs[5])
    low = [x.bfloat16() for x in inputs[:5]]
    for fn in (chunk_delta_rule, recurrent_delta_rule):
        o, state = fn(*low, initial_state=inputs[5])
        assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
        assert rel_err(o, ref) <= 2e-2 and rel_err(state, ref_state) <= 2e-2  # bf16 rounding of the inputs


class SubnormalOutputs:
    """Counts the subnormal values every op writes (a TorchDispatchMode), by op name. Views
    compute nothing and uninitialised tensors (``empty``) hold whatever memory held: skipped."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts, tiny = {}, torch.finfo(torch.float32).tiny

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                alias = func._schema.returns[0].alias_info if func._schema.returns else None
                is_view = alias is not None and not alias.is_write
                if "empty" not in func.__name__ and not is_view:
                    for o in out if isinstance(out, (tuple, list)) else [out]:
                        if isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.numel():
                            n = int(((o != 0) & (o.abs() < tiny)).sum())
                            if n:
                                counts[func.__name__] = counts.get(func.__name__, 0) + n
                return out

        self.mode, self.counts = Mode(), counts


@pytest.mark.parametrize("rate", [3.0, 16.0, 24.0], ids=["slow", "qwen3-next-init", "faster"])
def test_per_head_op_makes_no_subnormals(rate):
    """Strong decays (Qwen3-Next initialises rates up to 16: about -20 per token) made most of the
    chunk matrices subnormal, and every CPU operation on a subnormal is ~100x slower. The fused
    per-head op cuts decays below exp(-29) to exact zeros and masks T as it builds it, so no
    operation of its forward or backward writes a subnormal value, and it still equals the naive
    recurrence (the log-decay gradients included, which for such heads are ~1e-9)."""
    inputs = list(make_inputs(200, False, seed=17, b=2, hk=2, hv=4, dk=64, dv=64))
    # as Gated DeltaNet makes them: g = -A softplus(a + dt_bias), per-head A up to ``rate``
    gen = torch.Generator().manual_seed(5)
    A = torch.linspace(1.0, rate, 4)
    inputs[3] = -A * F.softplus(torch.randn(inputs[3].shape, generator=gen) + 1.0)
    inputs[3][:, ::11] = -0.01  # slow steps among the fast ones
    xs = [x.clone().requires_grad_(True) for x in inputs]
    watch = SubnormalOutputs()
    with watch.mode:
        o, state = chunk_delta_rule(*xs[:5], initial_state=xs[5], chunk_size=32)
        node = o.grad_fn
        while type(node).__name__ != "ChunkGatedDeltaBackward":  # the fused op ran
            node = node.next_functions[0][0]
        (o.square().sum() + state.square().sum()).backward()
    assert not watch.counts, f"ops wrote subnormal values: {watch.counts}"
    ref = run_with_grads(naive_delta_rule, inputs, True)
    errs = compare(run_with_grads(chunk_delta_rule, inputs, True, chunk_size=32), ref)
    assert max(errs.values()) <= REL, errs


@pytest.mark.parametrize("keys", ["aligned", "alternating"])
@pytest.mark.parametrize("decay", [0.0, 0.05, 3.0])
def test_per_head_op_with_aligned_keys(keys, decay):
    """The per-head op solves for T = (I + beta k k^T)^-1 without decays and multiplies by them
    afterwards. Its undecayed entries are largest when keys line up (k_i . k_j near +-1) and
    beta is near 1; the result must still match the float64 recurrence, forward and gradients."""
    q, k, v, g, beta, h0 = make_inputs(150, False, seed=29, b=1, hk=1, hv=2, dk=32, dv=16)
    gen = torch.Generator().manual_seed(31)
    base = F.normalize(torch.randn(32, generator=gen), dim=0)
    sign = torch.tensor([1.0 if keys == "aligned" or i % 2 == 0 else -1.0 for i in range(150)]).view(1, -1, 1, 1)
    k = F.normalize(base * sign + 0.02 * torch.randn(k.shape, generator=gen), dim=-1)
    g = torch.full_like(g, -decay)
    beta = torch.full_like(beta, 0.999)
    inputs = [q, k, v, g, beta, h0]
    ref = run_with_grads(naive_delta_rule, [x.double() for x in inputs], True)
    errs = compare(run_with_grads(chunk_delta_rule, inputs, True, chunk_size=32), ref)
    # the log-decay gradient of a fast head sums terms that nearly cancel: 1.6e-5 here at -3 per
    # token, the same before T was solved without decays
    dg = errs.pop("dg")
    assert max(errs.values()) <= REL and dg <= 3 * REL, (errs, dg)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_is_the_recurrence_bitwise(per_channel, dtype):
    """The no-autograd one-token path (``delta_rule_step``) computes the recurrence's lines in
    its order: bitwise its output and state, the caller's state untouched, and within REL of the
    naive reference."""
    q, k, v, g, beta, h0 = make_inputs(1, per_channel, seed=7, hk=2, hv=4)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    kept = h0.clone()
    with torch.enable_grad():  # the loop form
        ref = recurrent_delta_rule(q, k, v, g, beta, initial_state=h0)
    with torch.no_grad():
        got = recurrent_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[0].dtype == dtype
    assert torch.equal(h0, kept)
    naive = naive_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(), initial_state=h0.double())
    assert rel_err(got[1].double(), naive[1]) < REL


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_the_chunked_role_computes_in_fp32_under_autocast(per_channel):
    """The cpu backend's chunked op (also the cuda backend's without fla) under bf16 autocast
    gives its fp32 result: it raised in the chunk scan (out= products into fp32 buffers)."""
    from megamoe.layers.backends.cpu import CpuBackend

    op = CpuBackend().delta_rule(None)
    q, k, v, g, beta, h0 = make_inputs(21, per_channel)
    want = op.chunked(q, k, v, g, beta, initial_state=h0, chunk_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = op.chunked(q, k, v, g, beta, initial_state=h0, chunk_size=8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
