"""DeepSeek-V4 as a whole against transformers (tiny random config, layout ``WhCeHe``: one layer of each
attention kind, a hash-routed layer then top-k ones): logits (fp32 max abs <= 1e-4) and every
parameter's gradient (rel <= 1e-5) of a loss; the conversion round trip with greedy decoding of 32
tokens through the compressed decode cache equal to transformers' generate; the hub's own tensor
names; the MoE block (hash and sqrtsoftplus top-k, clamped SwiGLU) on its own.

Gradients: measured <= 4.2e-6 for every tensor but layer 0's mHC ``scale`` (2.9e-5: three numbers,
each a sum over every token that nearly cancels), so tensors of <= 3 numbers are held to 1e-4."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.convert import from_hf
from megamoe.convert.api import plan_entries
from megamoe.convert.family import get_family
from tests.numerics import rel_err
from tests.v4_utils import hf_config, randomize_v4, tiny_v4

LAYOUT = "WhCeHe"


@pytest.fixture(scope="module")
def hf_model():
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    return randomize_v4(DeepseekV4ForCausalLM(hf_config(LAYOUT)), seed=11).eval()


def ids(batch: int = 2, length: int = 37, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_logits_and_every_gradient_match_transformers(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, save_original_format=False)
    model = from_hf(tmp_path).float()
    x = ids()
    labels = torch.roll(x, -1, dims=1)
    ref = hf_model(input_ids=x).logits
    F.cross_entropy(ref.flatten(0, 1), labels.flatten()).backward()
    out = model(x)
    F.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
    assert (out - ref).abs().max() <= 1e-4
    theirs = {n: p.grad for n, p in hf_model.named_parameters()}
    hf_names = set(hf_model.state_dict())
    entries = plan_entries(get_family("deepseek_v4"), model.config, hf_model.config.to_dict(), hf_names)
    ours = dict(model.named_parameters())
    checked = 0
    for e in entries:
        grads = [theirs.get(n) for n in e.hf]
        if ours[e.mm].grad is None or grads[0] is None:  # the indexer, the hash table, the selection bias
            assert ours[e.mm].grad is None and grads[0] is None, e.mm
            continue
        # the mHC scales (3 numbers, each a sum over every token that nearly cancels) at round-off
        tol = 1e-4 if ours[e.mm].numel() <= 3 else 1e-5
        assert rel_err(ours[e.mm].grad, e.to_mm(grads)) <= tol, e.mm
        checked += 1
    assert checked == sum(p.requires_grad and p.grad is not None for p in model.parameters()) > 50
    hf_model.zero_grad()


def test_round_trip_and_greedy_decoding_with_the_compressed_cache(hf_model, tmp_path):
    from tests.conversion_harness import check_round_trip

    diffs = check_round_trip(hf_model, tmp_path, new_tokens=32, layouts=False)
    assert max(max(d) for d in diffs.values()) <= 1e-4


def test_hub_tensor_names_load(hf_model, tmp_path):
    """The hub's files: no ``model.`` prefix, ``embed``/``norm``/``head``, ``hc_head_fn``; mtp.* skipped."""
    from safetensors.torch import load_file, save_file

    hf_model.save_pretrained(tmp_path / "saved")
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    hub = {top.get(k, k.removeprefix("model.")): v for k, v in tensors.items()}
    hub["mtp.0.emb.weight"] = torch.zeros(2, 2)
    (tmp_path / "hub").mkdir()
    save_file(hub, tmp_path / "hub" / "model.safetensors")
    (tmp_path / "hub" / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    x = ids(1, 20)
    with torch.no_grad():
        assert (from_hf(tmp_path / "hub").float()(x) - hf_model(input_ids=x).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("hashed", [True, False])
def test_moe_block_matches_transformers(hashed):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    from megamoe.layers.mlp.moe import MoELayer
    from megamoe.layers.mlp.router import HashRouter, TopKRouter
    from megamoe.model.language_model import build_context
    from megamoe.layers.spec import ForwardInfo

    block = randomize_v4(DeepseekV4SparseMoeBlock(hf_config(LAYOUT), 0 if hashed else 1), seed=2)
    cfg = tiny_v4()
    layer = MoELayer(cfg.moe, build_context(cfg), 0, router=HashRouter if hashed else TopKRouter)
    sd = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    names = {"router.weight": "gate.weight", "experts.gate_up_weight": "experts.gate_up_proj",
             "experts.down_weight": "experts.down_proj", "shared_experts.linear_fc2.weight": "shared_experts.down_proj.weight",
             "router.table" if hashed else "router.expert_bias": "gate.tid2eid" if hashed else "gate.e_score_correction_bias"}
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.cat([sd["shared_experts.gate_proj.weight"], sd["shared_experts.up_proj.weight"]])
                    if name == "shared_experts.linear_fc1.weight" else sd[names[name]])
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    tok = ids(2, 9)
    want = block(x, input_ids=tok)
    got = layer(x, ForwardInfo(positions=torch.arange(9).expand(2, -1), token_ids=tok))
    assert rel_err(got, want) <= 1e-5
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(4))
    (gx_want,) = torch.autograd.grad(want, x, g)
    (gx_got,) = torch.autograd.grad(got, x, g)
    assert rel_err(gx_got, gx_want) <= 1e-5
