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


def test_hub_tensor_names_and_config_load(hf_model, tmp_path):
    """The hub's files: no ``model.`` prefix, ``embed``/``norm``/``head``, ``hc_head_fn``; mtp.* skipped;
    its config's legacy fields (``compress_ratios`` listing the MTP layer too, ``num_hash_layers``,
    ``rope_scaling``, ``qk_rope_head_dim``) read as transformers reads them."""
    import json

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
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "compress_rates", "partial_rotary_factor"):
        del config[key]
    config.update(compress_ratios=[0, 4, 128, 0], compress_rate_hca=8, num_hash_layers=1, qk_rope_head_dim=8,
                  compress_rope_theta=160000.0,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
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


# ---- decoding: the commands, cache options, parallel layouts --------------------------------------

@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v4") / "hf"
    hf_model.save_pretrained(path)
    return str(path)


PROMPTS = [[5, 9, 13, 2, 40, 7, 3, 8, 21, 33, 17, 4, 6], [11, 4], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


def test_batched_generation_with_every_cache_option(hf_dir):
    """Prompts of 13, 2 and 9 tokens in one left-padded batch: each row as when decoded alone; the
    paged cache's logits bitwise the contiguous cache's; int8 and fp8 blocks, fed the contiguous
    cache's tokens, within 5e-2 and 3e-1 of its logits at every step (measured 2.9e-2 and 2.1e-1 on
    this random model, nearly all from the window's keys, which are also the values: e4m3 keeps 3
    mantissa bits); the commands print the batch's tokens."""
    import functools

    from megamoe.inference.generate import generate_batch, left_pad, prefill
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.layers.cache.paged import PagedCache
    from tests.test_generate_parallel import run_command
    from tests.test_paged_cache import decode_logits

    model = from_hf(hf_dir).eval()
    want = generate_batch(model, PROMPTS, 10)
    assert want == [generate_batch(model, [p], 10)[0] for p in PROMPTS]
    pad = left_pad(PROMPTS)[1]
    logits = decode_logits(model, PROMPTS, InferenceCache(3, pad=pad), chunk=4, steps=6)
    assert torch.equal(decode_logits(model, PROMPTS, PagedCache(3, pad=pad, block_size=4), chunk=4, steps=6), logits)
    tokens = logits.argmax(-1, keepdim=True)  # [steps + 1, b, 1]: the tokens the quantised caches are fed
    for kv, bound in (("int8", 5e-2), ("fp8", 3e-1)):
        cache = PagedCache(3, pad=pad, block_size=4, kv_dtype=kv)
        with torch.no_grad():
            got = [prefill(model, left_pad(PROMPTS)[0], cache, 4)]
            got += [model(tokens[i], cache=cache)[:, -1].float() for i in range(6)]
        assert max(rel_err(g, w) for g, w in zip(got, logits)) <= bound, kv
    assert generate_batch(model, PROMPTS, 10, cache_factory=functools.partial(PagedCache, block_size=4)) == want
    argv = [hf_dir, *[a for p in PROMPTS for a in ("--ids", ",".join(map(str, p)))], "--max-new-tokens", "10"]
    code, out = run_command("generate", argv + ["--kv-cache", "paged"])
    assert code == 0 and out.split("\n")[-4:-1] == [str(w) for w in want]
    code, out = run_command("generate", argv + ["--kv-cache", "int8"])
    assert code == 0 and len(out.split("\n")[-4:-1]) == 3
    code, out = run_command("verify", [hf_dir, "--tokens", "32"])
    assert code == 0 and out.strip().endswith("OK")


def test_verify_at_tp2_and_with_a_cp2_prefill(pool, hf_dir):
    from tests.test_generate_parallel import run_command

    for flags in (["--tp", "2"], ["--cp", "2"]):
        results = pool(2).run(run_command, "verify", [hf_dir, *flags, "--tokens", "8"])
        assert results[0][0] == 0 and results[0][1].strip().endswith("OK") and results[1] == (0, ""), flags
