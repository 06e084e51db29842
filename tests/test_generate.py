"""Batched generation: prompts of different lengths in one left-padded batch decode exactly what
each prompt decodes alone, with every mixer (A, S, L, M, D, I, G, K) in the stack, with the
prompt given whole or in chunks; streamed steps; finished rows leave the batch."""
from __future__ import annotations

import pytest
import torch

from megamoe.layers.cache.decode import InferenceCache
from megamoe.inference.generate import generate_batch, left_pad, prefill, stream
from tests.mixer_utils import tiny_model
from tests.numerics import max_abs

LAYOUT = "AdSdLdMdDdIdGdKd"  # every mixer with a decode state
LENGTHS = (5, 9, 2, 7)  # odd and even pads: I's key pools must start at each row's first token


@pytest.fixture(scope="module")
def model():
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize

    m = LanguageModel(tiny_model(LAYOUT)).eval()
    initialize(m, m.groups, seed=0)
    return m


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 61, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.mark.parametrize("chunk", [None, 4])
def test_padded_prefill_logits_equal_each_prompt_alone(model, chunk):
    ps = prompts()
    ids, pad = left_pad(ps)
    with torch.no_grad():
        batch = prefill(model, ids, InferenceCache(len(ps), pad=pad), chunk)
        for i, p in enumerate(ps):
            assert max_abs(batch[i], model(torch.tensor([p]))[0, -1]) <= 1e-5


def test_padded_batch_decodes_the_same_tokens_as_each_prompt_alone(model):
    ps = prompts(1)
    alone = [generate_batch(model, [p], 8)[0] for p in ps]
    assert generate_batch(model, ps, 8) == alone
    assert generate_batch(model, ps, 8, prefill_chunk=3) == alone


def test_stream_drops_finished_rows_and_sampling_follows_the_seed(model):
    ps = prompts(2)
    greedy = generate_batch(model, ps, 6)
    eos = greedy[1][2]  # row 1 stops at its third token; the others go on unless they emit it too
    steps = list(stream(model, ps, 6, eos_token_id=eos))
    assert steps[0][0].tolist() == [0, 1, 2, 3]
    assert 1 not in steps[3][0].tolist()
    stopped = generate_batch(model, ps, 6, eos_token_id=eos)
    for want, got in zip(greedy, stopped):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:cut]
    sample = dict(do_sample=True, top_k=20, seed=5)
    assert generate_batch(model, ps, 6, **sample) == generate_batch(model, ps, 6, **sample)
    assert generate_batch(model, ps, 6, **sample) != greedy


def test_decode_steps_run_the_fused_functions_eagerly(model):
    """The prefill runs with the backend's fusion policy, each one-token step eagerly (compiled
    graphs cost a decode step more than they save, docs/performance.md); the policy is restored."""
    from megamoe.layers.ops.fusion import Fusion

    fusion = model.ctx.backend.fusion
    saved, fusion.mode = fusion.mode, "on"
    modes = []

    def forward(ids, **kw):  # records the policy each call sees; no model run (nothing compiles)
        modes.append(fusion.active(torch.device("cpu")))
        return torch.zeros(ids.size(0), ids.size(1), model.config.vocab_size)

    try:
        list(stream(model, prompts(), 3, forward=forward))
        assert modes == [True, False, False] and fusion.mode == "on"
    finally:
        fusion.mode = saved
    f = Fusion("on")
    with f.eager():
        assert not f.active(torch.device("cpu"))
    assert f.active(torch.device("cpu"))
