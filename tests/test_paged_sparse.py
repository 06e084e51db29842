"""A quantised paged cache under the sparse mixers (D, R, I, B) and DeepSeek-V4's compressed ones
(C, H): the indexers score the cached keys a tile at a time and the attentions read only the
selected steps (H: its entries a tile at a time), so a decode step's transient memory is bounded
by a tile and the per-key scores, never the dequantised history; the logits stay within the
quantisation tolerance of the contiguous cache's."""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import AttentionConfig, BlockIndexConfig, DSAConfig, MLAConfig
from megamoe.inference.generate import left_pad
from megamoe.layers.cache.decode import InferenceCache
from megamoe.layers.cache.paged import PagedCache
from tests.mixer_utils import tiny_model
from tests.numerics import rel_err
from tests.test_paged_cache import INT8_REL_SPARSE, build, decode_logits, prompts

SPARSE = "DdRdIdBd"


def sparse_config(layout: str = SPARSE, wide: bool = False):
    """D, R, I and B at test sizes; ``wide``: 128 and more numbers a key (the memory test: a
    dequantised history then outweighs the per-key scores)."""
    d = 64 if wide else 8
    return tiny_model(
        layout, hidden_size=64 if wide else 32,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=d, qk_norm=True, partial_rotary_factor=0.5,
                                  block_index=BlockIndexConfig(num_heads=2, head_dim=d, block_size=3, topk_blocks=2)),
        mla=MLAConfig(num_heads=4, q_lora_rank=12, kv_lora_rank=128 if wide else 10, qk_nope_head_dim=6,
                      qk_rope_head_dim=4, v_head_dim=5, indexer=DSAConfig(num_heads=3, head_dim=d, topk=4, kpool=2)))


@pytest.fixture(scope="module")
def sparse_model():
    return build(sparse_config())


def test_sparse_mixers_paged_bitwise_and_tiled_int8_within_tolerance(monkeypatch, sparse_model):
    """fp32 blocks: bitwise the contiguous cache's logits (padded prompts, chunked prefill); int8
    and fp8 read in 4-step tiles from 2-block chunks: within the sparse stacks' 8-bit bound of them
    (measured 4.8e-3 int8, 2.5e-2 fp8: bitwise what reading the history whole gave), and the int8
    logits equal the default tiling's to fp32 rounding."""
    from megamoe.layers.cache import blocks, paged

    ps = prompts()
    pad = left_pad(ps)[1]
    want = decode_logits(sparse_model, ps, InferenceCache(len(ps), pad=pad))
    assert torch.equal(decode_logits(sparse_model, ps, PagedCache(len(ps), pad=pad, block_size=4)), want)
    int8 = decode_logits(sparse_model, ps, PagedCache(len(ps), pad=pad, block_size=4, kv_dtype="int8"), feed=want)
    monkeypatch.setattr(paged, "TILE_TOKENS", 4)
    monkeypatch.setattr(blocks, "CHUNK_BLOCKS", 2)
    for kv_dtype in ("int8", "fp8"):
        got = decode_logits(sparse_model, ps, PagedCache(len(ps), pad=pad, block_size=4, kv_dtype=kv_dtype), feed=want)
        assert rel_err(got, want) < INT8_REL_SPARSE
        if kv_dtype == "int8":
            assert rel_err(got, int8) < 1e-5


def test_a_reserved_cache_reads_every_reserved_step_with_the_same_logits(monkeypatch, sparse_model):
    """A cache reserved for the generation (``PagedCache.reserve``: what compiled steps decode with)
    tiles every reserved step, the tiles past the kept ones masked (attention, D's scores) or cut
    off (I's pools, B's scores): int8 logits equal the growing cache's to fp32 rounding (4-step
    tiles; and at most 2 tiles a read, so 8-step ones), fp32 blocks bitwise; a forward past the
    reserved steps is refused in one line."""
    from megamoe.core.errors import ConfigError
    from megamoe.layers.cache import paged

    monkeypatch.setattr(paged, "TILE_TOKENS", 4)
    monkeypatch.setattr(paged, "TILE_MIN_TOKENS", 4)
    ps = prompts()
    pad = left_pad(ps)[1]
    for kv_dtype, tiles in (("fp32", 32), ("int8", 32), ("int8", 2)):
        monkeypatch.setattr(paged, "RESERVED_TILES", tiles)
        want = decode_logits(sparse_model, ps, PagedCache(len(ps), pad=pad, block_size=4, kv_dtype=kv_dtype))
        cache = PagedCache(len(ps), pad=pad, block_size=4, kv_dtype=kv_dtype)
        cache.reserve(9 + 6)
        got = decode_logits(sparse_model, ps, cache, feed=want)
        assert torch.equal(got, want) if kv_dtype == "fp32" else rel_err(got, want) < 1e-5
        assert cache.layer(1).tile_steps(("c", "k_rope")) == (4 if tiles == 32 else 8)
    with pytest.raises(ConfigError, match="16 time steps, past the 15 reserved"):
        sparse_model(torch.tensor([[3]] * len(ps)), cache=cache)


def step_transient(model, ids: torch.Tensor, tokens: int) -> int:
    """Live bytes one decode step holds above the int8 paged cache (the cache after the step) once
    ``tokens`` of ``ids`` [1, > tokens] were prefilled."""
    from megamoe.diagnostics.memory import LiveTensorBytes

    cache = PagedCache(1, block_size=16, kv_dtype="int8")
    with torch.no_grad():
        for a in range(0, tokens, 512):
            model(ids[:, a:min(tokens, a + 512)], cache=cache)
        tracker = LiveTensorBytes()
        tracker.add(cache.tensors())
        with tracker:
            model(ids[:, tokens:tokens + 1], cache=cache)
    return tracker.peak - sum(t.untyped_storage().nbytes() for t in cache.tensors())


def test_sparse_decode_transient_is_bounded_by_the_tile(monkeypatch):
    """A decode step after 512 and after 1024 tokens (64-step tiles): 512 more cached keys add less
    than 64 bytes each to what the step holds above the int8 cache (their scores), where reading a
    history whole added at least its fp32 values (512 B a key for each of these states; measured
    before: +0.6 MB for D, +0.8 MB for B)."""
    from megamoe.layers.cache import paged

    monkeypatch.setattr(paged, "TILE_TOKENS", 64)
    model = build(sparse_config(wide=True))
    ids = torch.randint(3, 61, (1, 1025), generator=torch.Generator().manual_seed(0))
    grown = step_transient(model, ids, 1024) - step_transient(model, ids, 512)
    assert grown < 512 * 64, grown


def test_v4_decode_transient_is_bounded_by_the_tile(monkeypatch):
    """DeepSeek-V4's C and H (entries of 128 numbers, C's indexer keys of 64) likewise: 512 more
    tokens (128 C entries, 64 H entries) add less than 64 KiB to what a decode step holds above the
    int8 cache (measured 28 KiB: the entries' ends and scores); reading the entries whole added
    176 KiB."""
    from megamoe.layers.cache import paged
    from tests.v4_utils import compressed, tiny_v4

    monkeypatch.setattr(paged, "TILE_TOKENS", 64)
    cfg = tiny_v4("CeHe", compressed=compressed(head_dim=128, rope_head_dim=16,
                                                indexer=DSAConfig(num_heads=4, head_dim=64, topk=8)))
    model = build(cfg)
    ids = torch.randint(3, 61, (1, 1025), generator=torch.Generator().manual_seed(0))
    grown = step_transient(model, ids, 1024) - step_transient(model, ids, 512)
    assert grown < 64 << 10, grown


def test_tiled_entries_decode_equals_the_reference():
    """HCA's online softmax over the window, uneven entry tiles (an empty one, unused slots) and
    the sink equals ``naive_compressed_attention`` over everything at once (padded keys masked)."""
    from megamoe.layers.ops.compressed_attention import EMPTY, Entries, naive_compressed_attention
    from megamoe.layers.ops.compressed_attention.tiled import tiled_entries_decode

    g = torch.Generator().manual_seed(0)
    b, s, h, d, t, n = 2, 3, 4, 8, 6, 11
    q, kv = torch.randn(b, s, h, d, generator=g), torch.randn(b, t, d, generator=g)
    values, sinks = torch.randn(b, n, d, generator=g), torch.randn(h, generator=g)
    end = torch.arange(n).expand(b, -1) * 2 + 1
    end[1, 8:] = EMPTY  # row 1 holds 8 entries
    q_start, kv_start = 20, 20 + s - t
    kv_doc = torch.ones(b, t, dtype=torch.long)
    kv_doc[0, :2] = 0  # row 0's first two window keys are padding
    where = dict(window=5, q_start=q_start, kv_start=kv_start, q_doc=kv_doc[:, -s:], kv_doc=kv_doc)
    want = naive_compressed_attention(q, kv, Entries(values, end, None), sinks, 0.3, **where)
    cuts = [4, 0, 1, 6]
    got = tiled_entries_decode(q, kv, zip(values.split(cuts, 1), end.split(cuts, 1)), sinks, 0.3, **where)
    assert rel_err(got, want) < 1e-6
