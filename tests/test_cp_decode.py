"""Decoding under context parallelism with the KV cache split by sequence (``megamoe.layers.cache.split``).

A model with softmax (A), sliding-window (S), MLA (M), DSA (D, R, I) and block-sparse (B) layers
and a Gated DeltaNet (G, replicated state) prefills two 12-token prompts split over CP=2 (alone, with TP=2
and with PP=2) and decodes with the cache split: every step's logits equal the single-process
run's (fp32, 1e-5 relative) with the contiguous and the paged cache (int8 and fp8 within the
paged cache's stated tolerance), the greedy tokens are the same, and each CP rank holds exactly
half the split keys' bytes of the single-process cache. Key tiles are cut small
(``TILE_TOKENS``) so each rank merges several tiles, masked ones among them; a chunked prefill
(12 tokens split over CP, then 4 in one forward, kept by the ranks by position) gives the
single-process logits.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.mixer_utils import tiny_model
from tests.numerics import rel_err
from tests.test_paged_cache import INT8_REL_SPARSE  # 8-bit keys with top-k selections (D, I, B): 5e-2

LAYOUT = "AdSdDdRdMdIdBdGd"
SPLIT_LAYERS, WINDOW_LAYER = (0, 1, 2, 3, 4, 5, 6), 1  # A, S, D, R, M, I, B: their keys / latents are split over CP
SPLIT_NAMES = ("k", "v", "c", "k_rope")  # (DSA's and B's indexer keys stay whole on every rank)
BLOCK_INDEX = dict(num_heads=2, head_dim=8, block_size=3, topk_blocks=2, local_blocks=1)  # B: 6 of up to 18 keys
PROMPTS = [[5, 9, 13, 2, 40, 7, 3, 8, 21, 33, 17, 4], [11, 4, 6, 50, 3, 9, 12, 30, 31, 32, 33, 34]]  # 12 = 3 * 2 * CP
LONGER = [p + [7, 1, 8, 2] for p in PROMPTS]  # 16 tokens: prefilled as 12 (under CP) + 4
STEPS = 6  # 18 cached positions: 9 on each CP rank
BLOCK = 3  # paged blocks of 3 tokens: a rank's 9 positions fill 3 blocks, the whole 18 fill 6


def build(groups=None, pp: int = 1):
    from megamoe.model.build import build_model, stage_cut
    from megamoe.model.weights import initialize
    from megamoe.parallel.groups import ParallelGroups

    from megamoe.core.config import BlockIndexConfig

    cfg = tiny_model(LAYOUT)
    cfg.attention = dataclasses.replace(cfg.attention, block_index=BlockIndexConfig(**BLOCK_INDEX))
    model = build_model(cfg, groups, **stage_cut(cfg, (groups.rank("pp") if pp > 1 else 0, pp))).eval()
    initialize(model, groups or ParallelGroups(), seed=0)
    return model


@torch.no_grad()
def decode_logits(forward, cache, steps: int = STEPS, feed: torch.Tensor | None = None,
                  chunk: int | None = None, prompts=PROMPTS) -> torch.Tensor:
    """[steps + 1, b, V]: the prompts' last logits, then greedy steps (the cache keeps 12 + steps);
    ``feed`` [steps + 1, b, V]: feed its greedy tokens instead of our own (8-bit keys may flip one);
    ``chunk``: prefill in pieces of that many tokens."""
    from megamoe.inference.generate import prefill

    out = [prefill(forward, torch.tensor(prompts), cache, chunk)]
    for i in range(steps):
        token = (out if feed is None else feed)[i].argmax(-1, keepdim=True)
        out.append(forward(token, cache=cache)[:, -1].float())
    return torch.stack(out)


def held_bytes(cache, layers=SPLIT_LAYERS) -> int:
    """Bytes of the split keys the ``layers`` keep: a contiguous cache's tensors, a paged cache's
    blocks in use."""
    states = [cache.layer(n) for n in layers]
    if hasattr(cache, "kv_bytes"):
        return sum(s.bytes_in_use() for state in states for name, s in state.stores.items() if name in SPLIT_NAMES)
    return sum(state[name].numel() * state[name].element_size() for state in states for name in SPLIT_NAMES
               if name in state)


def decode_split(layout: dict, want: torch.Tensor) -> dict:
    from megamoe.core.config import ParallelConfig
    from megamoe.inference.distributed import StageForward, cache_factory, inference_groups
    from megamoe.inference.generate import generate_batch
    from megamoe.layers.cache import split

    split.TILE_TOKENS = 4  # several key tiles per rank (the default 512 would be one)
    groups = inference_groups(ParallelConfig(**layout))
    model = build(groups, layout.get("pp", 1))
    forward = StageForward(model, groups)
    out = {}
    for kind in ("contiguous", "paged", "int8", "fp8"):
        cache = cache_factory(kind, BLOCK, forward)(len(PROMPTS))
        out[kind] = decode_logits(forward, cache, feed=want if kind in ("int8", "fp8") else None)
        out[kind + " bytes"] = held_bytes(cache)
    # a chunked prefill: the first 12 tokens under CP, the next 4 in one forward, split among the ranks
    out["chunked"] = decode_logits(forward, cache_factory("paged", BLOCK, forward)(len(PROMPTS)), chunk=12,
                                   prompts=LONGER)
    out["greedy"] = generate_batch(model, PROMPTS, STEPS, forward=forward, cache_factory=cache_factory("paged", BLOCK,
                                                                                                       forward))
    return out


@pytest.mark.parametrize("n,layout", [(2, dict(cp=2)), (4, dict(cp=2, tp=2)), (4, dict(cp=2, pp=2))],
                         ids=["cp2", "cp2-tp2", "cp2-pp2"])
def test_split_cache_decodes_the_single_process_logits(pool, n, layout):
    from megamoe.inference.generate import generate_batch
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.layers.cache.paged import PagedCache

    single = build()
    whole, paged = InferenceCache(len(PROMPTS)), PagedCache(len(PROMPTS), block_size=BLOCK)
    want = decode_logits(single, whole)
    want_longer = decode_logits(single, InferenceCache(len(PROMPTS)), prompts=LONGER)
    assert rel_err(decode_logits(single, paged), want) <= 1e-5
    tokens = generate_batch(single, PROMPTS, STEPS)
    for rank, got in enumerate(pool(n).run(decode_split, layout, want)):
        for kind in ("contiguous", "paged", "chunked"):
            err = rel_err(got[kind], want_longer if kind == "chunked" else want)
            assert err <= 1e-5, f"rank {rank}, {kind} cache: logits relative error {err:.2e}"
        for kind in ("int8", "fp8"):
            assert rel_err(got[kind], want) <= INT8_REL_SPARSE, f"rank {rank}, {kind} cache"
        assert got["greedy"] == tokens, f"rank {rank}"
        if layout == dict(cp=2):  # each CP rank holds half the keys: 9 of the 18 positions, 1 of S's 2
            assert 2 * got["contiguous bytes"] == held_bytes(whole), f"rank {rank}"
            unwindowed = [n for n in SPLIT_LAYERS if n != WINDOW_LAYER]  # (S: one block of 3 on every rank)
            assert 2 * got["paged bytes"] == held_bytes(paged, unwindowed) + 2 * held_bytes(paged, (WINDOW_LAYER,))


def test_split_cache_of_one_rank_is_the_plain_cache(monkeypatch):
    """Without CP the split caches keep every key on the one rank and attend through the same
    partial-and-merge path (the prompt as one multi-token forward, causal and window masks from
    positions, tiles of 4 keys): the logits are the plain cache's. Left padding and rolling back
    (speculative decoding) are refused in one line."""
    from megamoe.core.errors import ConfigError
    from megamoe.layers.cache import split
    from megamoe.layers.cache.decode import InferenceCache

    monkeypatch.setattr(split, "TILE_TOKENS", 4)
    model = build()
    want = decode_logits(model, InferenceCache(len(PROMPTS)), steps=3)
    for cache in (split.ContextSplitCache(len(PROMPTS)), split.PagedContextSplitCache(len(PROMPTS), block_size=BLOCK)):
        assert rel_err(decode_logits(model, cache, steps=3), want) <= 1e-5, type(cache).__name__
    with pytest.raises(ConfigError, match="equal length") as e:
        split.ContextSplitCache(2, pad=torch.tensor([2, 0]))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="rolled back"):
        split.ContextSplitCache(2).snapshot()
