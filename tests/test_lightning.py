"""Lightning attention (L): chunked == recurrent == closed form, pieces, decoding, MiniMax parity."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.layers.ops.lightning import lightning_chunked, lightning_naive, lightning_recurrent
from megamoe.layers.mixers.lightning import lightning_slopes
from tests.mixer_utils import (build_mixer, decode_steps, full_forward, load_from_hf, randomize,
                               tiny_model)
from tests.numerics import max_abs, rel_err

REL = 1e-5


def inputs(t: int, seed: int = 0, b: int = 2, h: int = 3, dk: int = 8, dv: int = 6):
    gen = torch.Generator().manual_seed(seed)
    q, k = (0.5 * torch.randn(b, t, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    slope = torch.tensor(lightning_slopes(h, 1, 4))  # decays 0.16 .. 0.6 per token
    return [x.requires_grad_(True) for x in (q, k, v, state)], slope


def grads(fn, tensors, slope, seed: int = 1, **kw):
    out, final = fn(*tensors[:3], slope, tensors[3], **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen)).sum() + (final * torch.randn(final.shape, generator=gen)).sum()
    got = torch.autograd.grad(loss, tensors)
    return [out, final, *got]


@pytest.mark.parametrize("t", [1, 63, 64, 65, 500])
def test_chunked_equals_recurrent_equals_naive(t):
    """fp32, with an initial state: outputs, final state, gradients of q, k, v and the state."""
    tensors, slope = inputs(t)
    names = ["out", "final state", "grad q", "grad k", "grad v", "grad state"]
    naive = grads(lightning_naive, tensors, slope)
    for fn, kw in [(lightning_chunked, {"block": 64}), (lightning_recurrent, {})]:
        for name, a, b in zip(names, grads(fn, tensors, slope, **kw), naive):
            assert rel_err(a, b) <= REL, f"{fn.__name__} t={t} {name}: {rel_err(a, b):.2e}"


def test_two_pieces_equal_one_pass():
    (q, k, v, s0), slope = inputs(150, seed=4)
    whole, final = lightning_chunked(q, k, v, slope, s0, block=64)
    first, mid = lightning_chunked(q[:, :70], k[:, :70], v[:, :70], slope, s0, block=64)
    second, final2 = lightning_chunked(q[:, 70:], k[:, 70:], v[:, 70:], slope, mid, block=64)
    assert rel_err(torch.cat([first, second], 1), whole) <= REL and rel_err(final2, final) <= REL


def test_chunked_keeps_fp32_state_for_bf16_inputs():
    (q, k, v, s0), slope = inputs(65, seed=5)
    out, final = lightning_chunked(q.bfloat16(), k.bfloat16(), v.bfloat16(), slope, s0)
    ref, ref_final = lightning_naive(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), slope, s0)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(final, ref_final) <= REL and rel_err(out, ref) <= 1e-2


def reference_mixer(mixer, x):
    """The mixer written out with the closed-form operator (parameter-gradient reference)."""
    bsz, s = x.shape[:2]
    qkv = F.silu(x @ mixer.linear_qkv.weight.T).view(bsz, s, mixer.heads, -1)
    q, k, v = qkv.chunk(3, dim=-1)
    o = lightning_naive(q, k, v, torch.tensor(mixer.slopes))[0].reshape(bsz, s, -1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + mixer.norm.eps) * mixer.norm.weight
    return (o * torch.sigmoid(x @ mixer.linear_gate.weight.T)) @ mixer.linear_proj.weight.T


def test_mixer_forward_and_param_grads_match_reference():
    mixer = build_mixer("L", tiny_model())
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out, ref = full_forward(mixer, x), reference_mixer(mixer, x)
    assert rel_err(out, ref) <= REL
    params = list(mixer.parameters())
    for a, b in zip(torch.autograd.grad(out.square().sum(), [x, *params]),
                    torch.autograd.grad(ref.square().sum(), [x, *params])):
        assert rel_err(a, b) <= REL


@pytest.mark.parametrize("prefill", [0, 5])
def test_decoding_equals_full_forward(prefill):
    mixer = build_mixer("L", tiny_model())
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(decode_steps(mixer, x, prefill), full_forward(mixer, x)) <= REL


def test_matches_minimax_lightning_attention():
    from transformers.models.minimax import modeling_minimax as hf_mod
    from transformers import MiniMaxConfig

    hf_cfg = MiniMaxConfig(hidden_size=32, num_attention_heads=4, head_dim=8, num_hidden_layers=3,
                           layer_types=["linear_attention"] * 3, block_size=4, hidden_act="silu")
    hf = hf_mod.MiniMaxLightningAttention(hf_cfg, layer_idx=1)
    randomize(hf)
    cfg = tiny_model("LdLdLd")  # 3 layers, layer 1: the slopes' layer factor is exercised
    cfg.lightning.block_size = 5  # HF uses blocks of 4: the result must not depend on it
    ours = build_mixer("L", cfg, layer_number=1)
    load_from_hf(ours, hf, {"linear_qkv.weight": "qkv_proj.weight", "linear_gate.weight": "output_gate.weight",
                            "norm.weight": "norm.weight", "linear_proj.weight": "out_proj.weight"})
    x = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(x, position_embeddings=None, attention_mask=None)[0]
        got = full_forward(ours, x)
    assert max_abs(got, want) <= 1e-5
