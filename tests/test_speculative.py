"""Speculative greedy decoding drafted by the MTP depths (``megamoe.inference.speculative``): the tokens are
plain greedy decoding's, with every mixer in the stack and two MTP depths (a linear and an
indexed one, whose caches are rolled back), for a left-padded batch with EOS; the drafter's
incremental caches give the drafts the MTP chain gives on the whole sequence; accepted drafts
(an oracle draft, some spoiled) keep the tokens; the command prints the accepted tokens per step."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.core.config import MTPConfig
from megamoe.inference.generate import generate_batch, left_pad
from megamoe.inference.speculative import SpeculativeStats, _Drafter, main_forward, stream_speculative
from tests.mixer_utils import tiny_model

LAYOUT = "AdSdLdMdDdIdGdKd"  # every mixer with a decode state
DEPTHS = 2
LENGTHS = (5, 9, 2, 7)


@pytest.fixture(scope="module")
def model():
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize

    cfg = dataclasses.replace(tiny_model(LAYOUT), mtp=MTPConfig(num_layers=DEPTHS, layout="GdId"))
    m = LanguageModel(cfg).eval()
    initialize(m, m.groups, seed=0)
    with torch.no_grad():  # logits of order one: greedy choices far from ties
        m.output_layer.weight.mul_(30)
    return m


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 61, (n,), generator=gen).tolist() for n in LENGTHS]


def speculative(model, ps, n, **kw) -> tuple[list[list[int]], SpeculativeStats]:
    out, stats = [[] for _ in ps], SpeculativeStats()
    for rows, tokens in stream_speculative(model, ps, n, stats=stats, **kw):
        for r, t in zip(rows.tolist(), tokens.tolist()):
            out[r].append(t)
    return out, stats


def test_speculative_tokens_equal_plain_greedy(model):
    ps = prompts()
    want = generate_batch(model, ps, 12, eos_token_id=7)
    got, stats = speculative(model, ps, 12, eos_token_id=7, prefill_chunk=4)
    assert got == want
    assert stats.drafts == DEPTHS and len(stats.accepted) >= 1
    one, _ = speculative(model, ps[:1], 12)
    assert one == generate_batch(model, ps[:1], 12)


@pytest.mark.parametrize("eos", [None, "mid-step"])
def test_accepted_drafts_keep_the_greedy_tokens(model, monkeypatch, eos):
    """Drafts from an oracle (plain greedy's next tokens), the last one spoiled every third step:
    whole and partial acceptance, rollback of the rejected, the same tokens; a row whose EOS comes
    among a step's accepted tokens stops there and leaves the batch."""
    ps, n = prompts(1), 14
    want = generate_batch(model, ps, n + DEPTHS + 1)
    if eos == "mid-step":  # a token row 0 produces by its 5th: rows stop at their first one
        eos = want[0][4]
        want = generate_batch(model, ps, n + DEPTHS + 1, eos_token_id=eos)
    ids, _ = left_pad(ps)
    start, calls = ids.size(1), []

    def oracle(self, seq):
        done = seq.size(1) - start  # tokens generated so far (every row advances alike)
        rows = [next(r for r in range(len(ps)) if torch.equal(ids[r], seq[i, :start])) for i in range(seq.size(0))]
        drafts = torch.tensor([(want[r] + [0] * (n + 2 * DEPTHS))[done:done + DEPTHS] for r in rows])
        calls.append(done)
        if len(calls) % 3 == 0:
            drafts[:, -1] = (drafts[:, -1] + 1) % 61
        return drafts

    monkeypatch.setattr(_Drafter, "draft", oracle)
    got, stats = speculative(model, ps, n, eos_token_id=eos)
    assert got == [row[:n] for row in want]
    assert DEPTHS in stats.accepted and DEPTHS - 1 in stats.accepted
    assert stats.tokens_per_step > 2.0 and len(stats.accepted) < n / 2
    if eos is not None:
        assert want[0][-1] == eos and len(want[0]) <= 5 and any(len(row) > 5 for row in want)


@torch.no_grad()
def test_drafts_equal_the_mtp_chain_over_the_whole_sequence(model):
    """The drafter commits what is verified and runs the rest on drafts in rolled-back forwards;
    its drafts equal each depth's greedy choice computed afresh on each row's whole sequence."""
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.model.mtp import mtp_logits

    ps = prompts(2)
    ids, pad = left_pad(ps)
    cache = InferenceCache(len(ps), pad=pad)
    drafter = _Drafter(model, len(ps), pad, lambda x: x)
    logits, hidden = main_forward(model, ids, cache)
    drafter.feed(hidden)
    seq = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        drafts = drafter.draft(seq)
        for r, p in enumerate(pad.tolist()):
            ext = seq[r, p:].tolist()
            for k in range(DEPTHS):
                depth_logits = mtp_logits(model, torch.tensor([ext]))[k + 1]
                ext.append(int(depth_logits[0, seq.size(1) - p - 2].argmax()))
                assert ext[-1] == int(drafts[r, k]), (step, r, k)
        accepted = int(torch.randint(0, DEPTHS + 1, (1,), generator=gen))  # as a verify step would
        new = torch.cat([drafts[:, :accepted], torch.randint(3, 61, (len(ps), 1), generator=gen)], 1)
        _, hidden = main_forward(model, torch.cat([seq[:, -1:], new[:, :-1]], 1), cache)
        drafter.feed(hidden)
        seq = torch.cat([seq, new], 1)


def test_generate_command_speculative(tmp_path):
    """``megamoe-generate --speculative mtp`` on a deepseek_v3 checkpoint with its MTP layer:
    plain greedy's tokens, then the accepted tokens per step; clashing flags are one line."""
    from megamoe.convert import from_hf
    from tests.test_cli_tools import tool
    from tests.test_mtp_convert import case_deepseek_v3, depth_weights, write_released

    case = case_deepseek_v3()
    hf_dir = write_released(case, depth_weights(32, case["depths"]), tmp_path)
    out = tool("generate.py", str(hf_dir), "--ids", "3,17,42,5", "--ids", "9,8", "--max-new-tokens", "6",
               "--speculative", "mtp").stdout.strip().splitlines()
    want = generate_batch(from_hf(hf_dir), [[3, 17, 42, 5], [9, 8]], 6)
    assert out[:2] == [str(row) for row in want]
    assert out[2].startswith("speculative (mtp, 2 draft(s) per step):") and "accepted tokens per step: " in out[2]
    bad = tool("generate.py", str(hf_dir), "--ids", "3", "--speculative", "mtp", "--sample", check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "--speculative mtp: not with --sample (greedy decoding in one process with the contiguous cache)")
