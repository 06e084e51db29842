"""The cuda backend on a GPU (marked `gpu`, skipped without CUDA; run by tools/gpu_check.sh, which
runs this file first: the decisive checks come first in it).

- the backend contract at bf16: a tiny model with every mixer whose maths is continuous (no
  top-k choice that bf16 rounding can flip) on the cuda backend under bf16 autocast against the
  local backend in fp32 on the CPU; logits and every gradient.
- fla's decode steps, then fla's delta-rule and lightning ops against megamoe's recurrence in float64 (on the CPU), at
  lengths that are not multiples of fla's chunk, with key heads shared by 1 or 2 value heads
  and decays from mild to strong; outputs, final states and every input gradient.
  Tolerances (rel_err): fp32 5e-3 (fla's kernels round through TF32 dots), bf16 3e-2.
- the grouped-GEMM experts and the FP8 roles against the reference on the device.
- a tiny hybrid MoE's loss curve trained on the GPU against the same run on the CPU.
- LoRA around the cuda backend's roles on the device against the local backend on the CPU.
- the te backend (where ``transformer_engine`` imports): its FP8 GEMM against bf16, its loss curve
  against the CPU's, and its state dict against the local backend's (checkpoints do not depend on it).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.dist import free_port
from tests.numerics import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REPO = Path(__file__).resolve().parent.parent
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


def _backend():
    from megamoe.layers.backends import get_backend

    return get_backend("cuda")


def _grads(fn, inputs, seed=0):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out, state = fn(*leaves)
    g = torch.Generator(device="cpu").manual_seed(seed)
    cot = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, leaves, cot)
    return [out.detach(), state.detach(), *grads]


def _delta_inputs(t, rep, per_channel, strong, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, hk, dk, dv = 2, 2, 64, 64
    hv = hk * rep
    q = F.normalize(torch.randn(b, t, hk, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(b, t, hk, dk, generator=g), dim=-1)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay = 8.0 if strong else 0.5                      # log-decays down to about -8 per token
    shape = (b, t, hv, dk) if per_channel else (b, t, hv)
    logd = -decay * torch.rand(shape, generator=g)
    beta = torch.rand(b, t, hv, generator=g)
    return [q, k, v, logd, beta]


def test_the_cuda_backend_at_bf16_matches_local_in_fp32():
    """Every continuous mixer (G K M L A S) with dense MLPs, bf16 autocast on the device against
    fp32 on the CPU. Tolerances from the same comparison of the cpu backend under CPU bf16
    autocast (logits 6e-3, all gradients together 9e-3, the worst tensor 6e-2: a decay
    parameter's): 3e-2, 3e-2 and 2e-1 (a wrong gradient is ~1)."""
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize
    from tests.lora_utils import token_batches
    from tests.mixer_utils import tiny_model

    ids = token_batches(1, 2, 37, 61)[0]
    runs = []
    for backend, device in (("cuda", "cuda"), ("local", "cpu")):
        model = LanguageModel(tiny_model("GdKdMdLdAdSd", backend=backend))
        initialize(model, model.groups, seed=0)
        model.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(ids.to(device))
        logits.float().square().mean().backward()
        runs.append({"logits": logits.detach().float().cpu(),
                     **{n: p.grad.float().cpu() for n, p in model.named_parameters()}})
    errs = {n: rel_err(runs[0][n], runs[1][n]) for n in runs[1]}
    names = [n for n in runs[1] if n != "logits"]
    together = rel_err(torch.cat([runs[0][n].flatten() for n in names]), torch.cat([runs[1][n].flatten() for n in names]))
    assert errs["logits"] <= 3e-2 and together <= 3e-2 and max(errs.values()) <= 2e-1, (together, errs)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_fla_decode_step_continues_the_chunked_state(per_channel):
    """fla's chunked op over 39 tokens, then its fused-recurrent step from that state (GDN's was
    called positionally: beta landed in fla's gk and decoding gave NaN)."""
    from megamoe.layers.ops.delta_rule.naive import recurrent_delta_rule

    inputs = _delta_inputs(40, 1 if per_channel else 2, per_channel, False)
    op = _backend().delta_rule(None)
    cuda = [x.cuda() for x in inputs]
    _, state = op.chunked(*(x[:, :39] for x in cuda))
    out, final = op.recurrent(*(x[:, 39:] for x in cuda), initial_state=state)
    ref, ref_state = recurrent_delta_rule(*(x.double() for x in inputs))
    assert rel_err(out.cpu(), ref[:, 39:]) <= TOL[torch.float32]
    assert rel_err(final.cpu(), ref_state) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype,t,rep,strong", [(torch.float32, 63, 1, False), (torch.float32, 500, 2, True),
                                                (torch.bfloat16, 130, 2, False)], ids=["fp32-63", "fp32-500", "bf16-130"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_fla_delta_rule_matches_the_float64_recurrence(dtype, t, rep, strong, per_channel):
    from megamoe.layers.ops.delta_rule.naive import recurrent_delta_rule

    torch.backends.cuda.matmul.allow_tf32 = False
    inputs = _delta_inputs(t, rep, per_channel, strong)
    op = _backend().delta_rule(None)
    got = _grads(lambda q, k, v, g, b: op.chunked(q, k, v, g, b),
                 [x.cuda().to(dtype) if i != 3 else x.cuda() for i, x in enumerate(inputs)])
    want = _grads(lambda q, k, v, g, b: recurrent_delta_rule(q, k, v, g, b), [x.double() for x in inputs])
    for name, a, w in zip(("out", "state", "dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert rel_err(a.float().cpu(), w) <= TOL[dtype], (name, rel_err(a.float().cpu(), w))


@pytest.mark.parametrize("t", [1, 77])
def test_fla_lightning_matches_the_float64_recurrence(t):
    from megamoe.layers.ops.lightning import lightning_recurrent

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, t, 4, 64, generator=g) * 0.3 for _ in range(3))
    slope = torch.tensor([0.9, 0.3, 0.05, 0.01])
    op = _backend().lightning(None)
    form = op.recurrent if t == 1 else op.chunked
    got = _grads(lambda *x: form(*x, slope.cuda()), [q.cuda(), k.cuda(), v.cuda()])
    want = _grads(lambda *x: lightning_recurrent(*x, slope.double()), [q.double(), k.double(), v.double()])
    for name, a, w in zip(("out", "state", "dq", "dk", "dv"), got, want):
        assert rel_err(a.float().cpu(), w) <= TOL[torch.float32], name


def test_grouped_gemm_experts_match_the_reference():
    from megamoe.layers.ops.grouped_gemm import swiglu_experts

    g = torch.Generator().manual_seed(4)
    counts = [40, 0, 130, 3, 77, 16]
    x = torch.randn(200, 256, generator=g).cuda().bfloat16().requires_grad_()
    idx = torch.randint(0, 200, (sum(counts),), generator=g).cuda()
    w1 = (torch.randn(6, 256, 256, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
    w2 = (torch.randn(6, 256, 128, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
    outs = []
    for kernel in ("grouped_mm", "reference"):
        y = swiglu_experts(kernel, x, idx, counts, None, w1, w2, 200)
        outs.append([y, *torch.autograd.grad(y, (x, w1, w2), torch.ones_like(y))])
    for a, b in zip(*outs):
        assert rel_err(a, b) <= 1e-2


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_tiered_experts_on_cuda_match_resident(tmp_path, tier):
    """The expert store's GPU side, which no CPU run reaches (tests/test_expert_store.py runs the rest):
    cache slots on the device, reads through pinned host buffers copied on a side stream (the
    prefetch thread's too), the host tier pinned; fp32, the CPU test's tolerance."""
    from tests.test_expert_store import stored_pair, check_stored_matches_resident

    resident, tiered, store = stored_pair(tmp_path, 0.05, "auto", "per_expert", tier, device="cuda")
    assert not store.mapped and store.cache.cuda
    check_stored_matches_resident(resident, tiered, store)
    store.close()


def test_tiered_cache_refill_waits_for_the_copy_out_of_its_slot():
    """One slot: expert 1 is copied out on the current stream behind a long sleep, then expert 2
    evicts it and is read into the same slot on the side stream. The refill must wait for the
    queued copy out (it did not: expert 1's copy read expert 2's values)."""
    from megamoe.expert_store.slot_cache import ExpertCache

    shapes = ((512, 256), (256, 256))
    cache = ExpertCache(sum(a * b for a, b in shapes) * 4, "cuda", torch.float32, shapes,
                        lambda key, w1, w2: (w1.fill_(key), w2.fill_(key)), prefetch=False)
    assert cache.size == 1
    outs = {key: [torch.zeros(s, device="cuda") for s in shapes] for key in (1, 2)}
    torch.cuda._sleep(2 ** 28)  # about 0.1 s on the current stream: the copies out queue behind it
    cache.copy(1, *outs[1])
    cache.copy(2, *outs[2])
    torch.cuda.synchronize()
    assert all((o == key).all() for key in (1, 2) for o in outs[key]), {k: o[0][0, 0].item() for k, o in outs.items()}
    cache.close()


def _check_against_bf16(linear, x, w, tol=6e-2):
    """An FP8 GEMM ``linear(x, w)``: output and both input gradients within ``tol`` of bf16's."""
    got = [linear(x, w)]
    got += torch.autograd.grad(got[0], (x, w), torch.ones_like(got[0]))
    want = [F.linear(x, w)]
    want += torch.autograd.grad(want[0], (x, w), torch.ones_like(want[0]))
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol


def test_fp8_linear_on_cuda_against_bf16():
    from megamoe.layers.ops.fp8.linear import fp8_linear

    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 1024, generator=g).cuda().bfloat16().requires_grad_()
    w = (torch.randn(2048, 1024, generator=g) * 0.03).cuda().bfloat16().requires_grad_()
    _check_against_bf16(fp8_linear, x, w)


def test_lora_on_the_cuda_backend_matches_local_on_the_cpu():
    """Adapters wrapping the cuda backend's roles on the device (fla mixers, the experts' adapters
    in the grouped-GEMM form), fp32: logits and every adapter gradient against the same adapted
    model on the local backend on the CPU (fla's TF32 dots: 1e-2)."""
    from megamoe.lora import lora_parameters
    from tests.lora_utils import build_lora_model, lora_model_config, token_batches

    ids = token_batches(1, 2, 13, 61)[0]
    runs = []
    for backend, device in (("cuda", "cuda"), ("local", "cpu")):
        model = build_lora_model(lora_model_config("GeKdMeAe", backend=backend)).to(device)
        logits = model(ids.to(device))
        logits.square().mean().backward()
        runs.append([logits.detach().cpu()] + [p.grad.cpu() for _, p in sorted(lora_parameters(model))])
    assert len(runs[0]) > 30
    for a, b in zip(*runs):
        assert rel_err(a, b) <= 1e-2


def _losses(tmp: Path, device: str, *extra: str) -> list[float]:
    env = dict(os.environ, MASTER_PORT=str(free_port()), MEGAMOE_FUSION="off")
    run = subprocess.run([sys.executable, str(REPO / "tools/pretrain.py"), "--config", "tiny_hybrid_moe",
                          "train.steps=8", f"train.device={device}", "train.precision=fp32", f"checkpoint.dir={tmp}",
                          "logging.interval=1", "logging.progress=false", *extra], env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, f"pretrain on {device} exited {run.returncode}:\n{run.stderr[-4000:]}"
    lines = (tmp / "tb" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_loss_curve_on_the_gpu_matches_the_cpu(tmp_path):
    """fp32 on both sides (no TF32): fla and torch's grouped GEMM against the CPU backend's ops."""
    cpu = _losses(tmp_path / "cpu", "cpu")
    gpu = _losses(tmp_path / "gpu", "cuda")
    assert len(cpu) == len(gpu) == 8
    assert max(abs(a - b) / abs(b) for a, b in zip(gpu, cpu)) < 2e-3, (gpu, cpu)


te_only = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                             reason="needs transformer_engine (a CUDA-only extra: pip install 'megamoe[te]')")


@te_only
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_fp8_gemm_against_bf16(recipe):
    from megamoe.layers.backends.te import FP8Scope, TEGemm, make_recipe

    g = torch.Generator().manual_seed(6)
    x = torch.randn(500, 1024, generator=g).cuda().bfloat16().requires_grad_()  # 500 rows: padded to 16
    w = (torch.randn(2048, 1024, generator=g) * 0.03).cuda().bfloat16().requires_grad_()
    _check_against_bf16(TEGemm(FP8Scope(make_recipe(recipe), None)), x, w)


@te_only
def test_te_backend_state_dict_is_the_local_one():
    from megamoe.model.language_model import LanguageModel
    from tests.mixer_utils import tiny_model

    te = LanguageModel(tiny_model("GdAd", backend="te"))
    local = LanguageModel(tiny_model("GdAd", backend="local"))
    assert {k: v.shape for k, v in te.state_dict().items()} == {k: v.shape for k, v in local.state_dict().items()}


@te_only
def test_te_loss_curve_matches_the_cpu(tmp_path):
    """fp32, no FP8: Transformer Engine's GEMMs against the CPU backend's."""
    cpu = _losses(tmp_path / "cpu", "cpu")
    te = _losses(tmp_path / "te", "cuda", "model.backend=te")
    assert len(cpu) == len(te) == 8
    assert max(abs(a - b) / abs(b) for a, b in zip(te, cpu)) < 2e-3, (te, cpu)
