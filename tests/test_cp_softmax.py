"""Softmax-family mixers (A, S, M, D, I) under context parallelism and with packed documents.

CP runs (gloo) equal the single-process run of the same weights on the full sequence: outputs,
input gradients and every parameter gradient (summed over CP), fp32, within 1e-5 relative, at a
length (40) that is not a power of two. Packed documents equal the documents run one by one.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.core.config import ParallelConfig
from megamoe.parallel.context import position_in_document
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import build_mixer, param_grad_errors, tiny_model
from tests.numerics import rel_err

REL = 1e-5
SEQ = 40
LETTERS = ["A", "S", "M", "D", "I"]


def packed_documents(seq: int) -> torch.Tensor:
    """[2, seq] document ids: row 0 three documents (one crossing CP chunk borders), row 1 two."""
    a, b = seq // 5 + 1, seq // 2 - 3
    row0 = torch.cat([torch.full((a,), 0), torch.full((b,), 1), torch.full((seq - a - b,), 2)])
    row1 = torch.cat([torch.full((seq - 11,), 0), torch.full((11,), 1)])
    return torch.stack([row0, row1])


def model_for(letter: str, model: dict | None, window: int = 7):
    cfg = tiny_model(**(model or {}))
    if letter == "S":  # 7: longer than a CP=4 chunk (5 tokens), it reaches two chunks back
        cfg.attention = dataclasses.replace(cfg.attention, sliding_window=window)
    return cfg


def cp_case(letter: str, cp: int, tp: int = 1, sp: bool = False, docs: bool = False, seed: int = 0,
            model: dict | None = None, tile: int | None = None, window: int = 7, seq: int = SEQ) -> dict:
    """Relative errors of a CP (x TP) mixer against the single-process one, on this rank, for
    ``seq`` tokens. ``tile``: ring attention's score tile for this run (default: its own)."""
    from megamoe.layers.ops.attention import context as context_attention

    default_tile = context_attention.TILE
    context_attention.TILE = tile or default_tile
    try:
        return _cp_case(letter, cp, tp, sp, docs, seed, model, window, seq)
    finally:
        context_attention.TILE = default_tile


def _cp_case(letter, cp, tp, sp, docs, seed, model, window, seq) -> dict:
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups
    from megamoe.model.weights import finalize_grads

    cfg = model_for(letter, model, window)
    groups = build_groups(ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp))
    ref = build_mixer(letter, cfg, seed=seed)
    state = {name: p.detach().clone() for name, p in ref.named_parameters()}
    par = build_mixer(letter, cfg, groups, sp=sp, full_state=state)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq, cfg.hidden_size, generator=gen)
    g = torch.randn(2, seq, cfg.hidden_size, generator=gen)
    documents = packed_documents(seq) if docs else None
    pos = position_in_document(documents) if docs else torch.arange(seq).expand(2, -1)
    shard = ContextShard(groups.cp, seq)
    tp_rank = groups.tp_rank
    local = lambda t: shard.split(t).chunk(tp, dim=1)[tp_rank] if sp else shard.split(t)  # noqa: E731

    xr, xp = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
    yr = ref(xr, ForwardInfo(positions=pos, documents=documents))
    yp = par(xp, ForwardInfo(positions=shard.split(pos), cp=shard, documents=documents))
    (yr * g).sum().backward()
    (yp * local(g)).sum().backward()
    finalize_grads(par, groups)
    errs = {"out": rel_err(yp, local(yr)), "grad x": rel_err(xp.grad, local(xr.grad))}
    return param_grad_errors(ref, par, groups, errs, cp_group=groups.cp)


def check(results: list[dict], what: str) -> None:
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"{what} rank {rank}: relative errors over {REL}: {bad}"
    assert sum(k.startswith("grad ") for k in results[0]) >= 4  # the gradients were compared


@pytest.mark.parametrize("letter", LETTERS)
def test_cp2_equals_single_process(pool, letter):
    check(pool(2).run(cp_case, letter, 2), f"{letter} cp=2")


@pytest.mark.parametrize("letter", LETTERS)
def test_cp4_equals_single_process(pool, letter):
    check(pool(4).run(cp_case, letter, 4), f"{letter} cp=4")


@pytest.mark.parametrize("window", [11, 12])
def test_cp2_sliding_window_at_the_halo_limit(pool, window):
    """CP=2, chunks of 10: window 11 reaches exactly the whole previous chunk (halo of 10), 12
    one token further (the ring)."""
    check(pool(2).run(cp_case, "S", 2, docs=True, window=window), f"S cp=2 window {window}")


@pytest.mark.parametrize("letter", LETTERS)
def test_cp2_small_tiles_equal_single_process(pool, letter):
    """TILE=3: ring attention in 3 x 3 tiles (chunks of 10 tokens: tiles of 3, 3, 3, 1); MLA's
    checkpointed query tiles, the indexer's selection passes and DSA's checkpointed sparse tiles
    of 16 rows (20 local queries: 16 + 4); packed documents."""
    check(pool(2).run(cp_case, letter, 2, docs=True, tile=3), f"{letter} cp=2 tiles of 3")


@pytest.mark.parametrize("sp, docs", [(True, False), (False, True)], ids=["sp", "packed"])
@pytest.mark.parametrize("letter", LETTERS)
def test_cp2_tp2_equals_single_process(pool, letter, sp, docs):
    check(pool(4).run(cp_case, letter, 2, 2, sp, docs), f"{letter} cp=2 x tp=2 (sp={sp}, packed={docs})")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("letter", LETTERS)
def test_cp_packed_documents_equal_single_process(pool, letter, cp):
    check(pool(cp).run(cp_case, letter, cp, docs=True), f"{letter} cp={cp} packed")


# ---- packed documents without CP ------------------------------------------------------------

@pytest.mark.parametrize("tile", [None, 3], ids=["", "tile3"])
@pytest.mark.parametrize("letter", LETTERS)
def test_packed_documents_equal_documents_one_by_one(letter, tile, monkeypatch):
    """One packed row equals each of its documents run alone (outputs, input and weight gradients);
    tile 3: the indexer selects in passes of 16 queries."""
    from megamoe.layers.ops.attention import context as context_attention

    monkeypatch.setattr(context_attention, "TILE", tile or context_attention.TILE)
    cfg = model_for(letter, None)
    mixer = build_mixer(letter, cfg, seed=3)
    gen = torch.Generator().manual_seed(3)
    documents = packed_documents(SEQ)[:1]
    x = torch.randn(1, SEQ, cfg.hidden_size, generator=gen, requires_grad=True)
    g = torch.randn(1, SEQ, cfg.hidden_size, generator=gen)
    y = mixer(x, ForwardInfo(positions=position_in_document(documents), documents=documents))
    (y * g).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    mixer.zero_grad()
    outs, grads_x = [], []
    for doc in documents[0].unique():
        sel = documents[0] == doc
        xd = x.detach()[:, sel].clone().requires_grad_(True)
        yd = mixer(xd, ForwardInfo(positions=torch.arange(int(sel.sum())).unsqueeze(0)))
        (yd * g[:, sel]).sum().backward()
        outs.append(yd)
        grads_x.append(xd.grad)
    assert rel_err(y, torch.cat(outs, 1)) <= REL
    assert rel_err(x.grad, torch.cat(grads_x, 1)) <= REL
    for n, p in mixer.named_parameters():
        if n in packed_grads:
            assert rel_err(packed_grads[n], p.grad) <= REL, n
    assert len(packed_grads) >= 4


@pytest.mark.parametrize("letter", ["A", "M", "D"])
@pytest.mark.parametrize("case", ["decode step", "left-padded"])
def test_cp_with_a_cache_past_its_prefill_is_refused_before_the_cache_changes(letter, case):
    """CP with a decode cache is a prefill of equal-length rows (tests/test_cp_generate.py); a cache
    that has already seen tokens, or a left-padded one, is one line and leaves the cache as it was."""
    from types import SimpleNamespace

    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.core.errors import ConfigError

    mixer = build_mixer(letter, model_for(letter, None))
    cache = InferenceCache(1, pad=torch.tensor([1]) if case == "left-padded" else None)
    if case == "decode step":
        cache.advance(4)
    info = ForwardInfo(positions=cache.positions(4), cache=cache, cp=SimpleNamespace(size=2))
    with pytest.raises(ConfigError, match=r"only a first forward \(prefill\) of rows of equal length"):
        mixer(torch.randn(1, 4, 32), info)
    assert not cache.layer(mixer.layer_number)  # nothing half-written


def ring_bytes_case(cp: int) -> int:
    """Bytes this rank sends (isend, gloo) in one forward + backward of an ``A`` layer."""
    import torch.distributed as dist

    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(cp=cp))
    cfg = model_for("A", None)
    mixer = build_mixer("A", cfg, groups)
    shard = ContextShard(groups.cp, SEQ)
    x = torch.randn(2, shard.local_len, cfg.hidden_size, requires_grad=True)
    sent, isend = [], dist.isend
    dist.isend = lambda t, *a, **kw: sent.append(t.numel() * t.element_size()) or isend(t, *a, **kw)
    try:
        mixer(x, ForwardInfo(positions=shard.local_index().expand(2, -1), cp=shard)).sum().backward()
    finally:
        dist.isend = isend
    return sum(sent)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_match_the_documented_formula(pool, cp):
    """docs/mixers.md: forward (P-1) b (S/P) Hk (d+dv) e; backward the same plus P b (S/P) Hk (d+dv) 4."""
    b, hk, d = 2, 2, 8
    block = b * (SEQ // cp) * hk * (d + d)
    want = (cp - 1) * block * 4 + (cp - 1) * block * 4 + cp * block * 4
    assert pool(cp).run(ring_bytes_case, cp) == [want] * cp


@pytest.mark.parametrize("letter", LETTERS)
def test_documents_of_the_wrong_shape_are_one_line(letter):
    from megamoe.core.errors import DataError

    mixer = build_mixer(letter, model_for(letter, None))
    info = ForwardInfo(positions=torch.arange(8).unsqueeze(0), documents=torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(DataError, match=r"documents has shape \[1, 9\], expected \[1, 8\]"):
        mixer(torch.randn(1, 8, 32), info)
