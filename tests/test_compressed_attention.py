"""DeepSeek-V4 attention (W, C, H): the mixers against transformers' DeepseekV4Attention (outputs,
input and every parameter gradient, fp32 rel <= 1e-5), the tiled op against the dense reference,
the vectorised pooling against transformers-shaped compression, decoding (contiguous, paged,
int8) against the full forward, packed documents against documents run alone, and left padding."""
from __future__ import annotations

import pytest
import torch

from megamoe.layers.cache.decode import InferenceCache
from megamoe.layers.ops.compressed_attention import (chunk_compressed_attention, find_blocks, naive_compress,
                                                      naive_compressed_attention, pool_blocks)
from megamoe.layers.cache.paged import PagedCache
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import build_mixer, decode_steps, full_forward
from tests.numerics import rel_err
from tests.v4_utils import ATTN_NAMES, copy_attention, hf_attention_inputs, hf_config, randomize_v4, tiny_v4

REL = 1e-5
LETTERS = "WCH"


def mixer(letter: str, seed: int = 0, cfg=None):
    m = build_mixer(letter, cfg or tiny_v4(), layer_number=1, seed=seed)
    randomize_v4(m, seed)
    return m


def grads(module, x: torch.Tensor, fn, seed: int = 5) -> dict[str, torch.Tensor]:
    """Output, input gradient and every parameter gradient for a fixed random cotangent."""
    module.zero_grad()
    x = x.clone().requires_grad_(True)
    y = fn(module, x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    (y * g).sum().backward()
    out = {"out": y.detach(), "grad x": x.grad}
    out.update({n: p.grad for n, p in module.named_parameters()})
    return out


def assert_close(got: dict, want: dict, tol: float = REL) -> None:
    for name, w in want.items():
        g = got[name]
        if w is None or g is None:  # the indexer: indices only, no gradient (as in transformers)
            assert w is None and g is None, name
            continue
        assert rel_err(g, w) <= tol, f"{name}: {rel_err(g, w):.2e}"


@pytest.mark.parametrize("letter", LETTERS)
def test_matches_transformers_attention(letter):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    hf_cfg = hf_config("WeCeHe")
    hf = randomize_v4(DeepseekV4Attention(hf_cfg, "WCH".index(letter)), seed=3)
    ours = mixer(letter)
    copy_attention(ours, hf)
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(1))
    pe, pos, mask = hf_attention_inputs(hf_cfg, x)
    want = grads(hf, x, lambda m, t: m(t, pe, pos, mask)[0])
    got = grads(ours, x, full_forward)
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    for name, _ in ours.named_parameters():
        src = ATTN_NAMES[name]
        parts = [theirs[s] for s in (src if isinstance(src, tuple) else (src,))]
        want[name] = None if parts[0] is None else torch.cat(parts)
    assert_close(got, {k: v for k, v in want.items() if k in got})


@pytest.mark.parametrize("letter", LETTERS)
def test_tiled_equals_dense_reference(letter):
    """Query tiles of 5 rows (windows and entries crossing tiles) against the dense scores."""
    tiled, dense = mixer(letter), mixer(letter)
    tiled.core = lambda *a, **k: chunk_compressed_attention(*a, **k, tile=5)
    dense.core = naive_compressed_attention
    x = torch.randn(2, 29, 32, generator=torch.Generator().manual_seed(2))
    assert_close(grads(tiled, x, full_forward), grads(dense, x, full_forward))


@pytest.mark.parametrize("overlap", [False, True])
def test_pooling_matches_transformers_shaped_compression(overlap):
    gen = torch.Generator().manual_seed(0)
    rate, d = 4, 6
    w = d * (2 if overlap else 1)
    kv, gate = torch.randn(2, 23, w, generator=gen), torch.randn(2, 23, w, generator=gen)
    bias = torch.randn(rate, w, generator=gen)
    blocks = find_blocks(torch.arange(23).expand(2, -1), rate)
    assert blocks.valid.all() and blocks.start[0].tolist() == [0, 4, 8, 12, 16]
    assert rel_err(pool_blocks(kv, gate, bias, blocks, rate, overlap), naive_compress(kv, gate, bias, rate, overlap)) < 1e-6


def test_blocks_follow_documents_and_padding():
    # a document of 6 tokens, one of 9, padding: blocks of 4 from each document's start
    p = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8], [-1, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    blocks = find_blocks(p, 4)
    assert blocks.start[0].tolist() == [0, 6, 10] and blocks.valid[0].tolist() == [True, True, True]
    assert blocks.start[1, :3].tolist() == [2, 6, 10] and blocks.prev[1].tolist() == [False, True, True]
    assert blocks.prev[0].tolist() == [False, False, True]
    late = find_blocks(p, 4, first_end=13)  # only blocks ending at or after index 13; T // 4 slots
    assert late.start[1][late.valid[1]].tolist() == [10] and late.valid.shape == (2, 3)


@pytest.mark.parametrize("letter", LETTERS)
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_decoding_equals_full_forward(letter, cache):
    m = mixer(letter)
    x = torch.randn(2, 27, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = full_forward(m, x)
        if cache == "contiguous":
            for prefill in (0, 9):
                assert rel_err(decode_steps(m, x, prefill), full) < REL
        else:
            assert torch.equal(run_cache(m, x, PagedCache(2, block_size=4), [9, 5] + [1] * 13),
                               run_cache(m, x, InferenceCache(2), [9, 5] + [1] * 13))
            assert rel_err(run_cache(m, x, PagedCache(2, block_size=4, kv_dtype="int8"), [9] + [1] * 18), full) < 0.05


def run_cache(m, x, cache, steps):
    outs, start = [], 0
    for n in steps:
        outs.append(m(x[:, start:start + n], ForwardInfo(positions=cache.positions(n), cache=cache)))
        cache.advance(n)
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("letter", "CH")
def test_left_padded_rows_equal_rows_alone(letter):
    m = mixer(letter)
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(1, 21, 32, generator=gen), torch.randn(1, 14, 32, generator=gen)
    with torch.no_grad():
        want_a, want_b = decode_steps(m, a, prefill=12), decode_steps(m, b, prefill=5)
        x = torch.cat([a, torch.cat([torch.zeros(1, 7, 32), b], dim=1)])
        cache = InferenceCache(2, pad=torch.tensor([0, 7]))
        got = run_cache(m, x, cache, [12] + [1] * 9)
    assert rel_err(got[:1], want_a) < REL and rel_err(got[1:, 7:], want_b) < REL


@pytest.mark.parametrize("letter", LETTERS)
def test_packed_documents_equal_documents_alone(letter):
    """A packed row (documents of 13, 3 and 15 tokens) equals the documents run one by one:
    outputs, input gradients and every parameter gradient."""
    m = mixer(letter)
    gen = torch.Generator().manual_seed(7)
    lengths = [13, 3, 15]
    x = torch.randn(1, sum(lengths), 32, generator=gen)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = grads(m, x, lambda mod, t: mod(t, ForwardInfo(positions=pos, documents=docs)))
    cot = torch.randn(packed["out"].shape, generator=torch.Generator().manual_seed(5))
    m.zero_grad()
    xs = x.clone().requires_grad_(True)
    outs, a = [], 0
    for n in lengths:
        y = full_forward(m, xs[:, a:a + n])
        (y * cot[:, a:a + n]).sum().backward()
        outs.append(y.detach())
        a += n
    alone = {"out": torch.cat(outs, dim=1), "grad x": xs.grad, **{n: p.grad for n, p in m.named_parameters()}}
    assert_close(packed, alone)
