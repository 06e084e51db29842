"""Block-sparse attention B (MiniMax-M3): the tiled selection equals the naive [s, T] pooling,
the gathered attention equals the dense-mask reference forward and backward, decoding (also
left-padded and in pieces) equals the full forward, packed documents equal documents one by
one, the mixer matches transformers' MiniMaxM3VLAttention, and TP=2 / CP=2 equal one process."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.core.config import BlockIndexConfig
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import (build_mixer, causal_additive_mask, check_sparse_equals_dense, decode_steps,
                               full_forward, load_from_hf, mixer_tp_case, randomize, tiny_model)
from tests.numerics import max_abs, rel_err

REL = 1e-5
INDEX = BlockIndexConfig(num_heads=2, head_dim=8, block_size=3, topk_blocks=2, local_blocks=1)


def model(index: BlockIndexConfig = INDEX, **attention):
    """tests.mixer_utils' tiny model (4 heads, 2 KV groups, head 8, half rotated, zero-centred
    QK-norm) with the block indexer; 3-key blocks, 2 kept per query (6 of up to 20 keys)."""
    cfg = tiny_model("BdAd")
    cfg.attention = dataclasses.replace(cfg.attention, output_gate=False, sliding_window=0, block_index=index,
                                        **attention)
    return cfg


def x_of(seed: int, t: int = 20) -> torch.Tensor:
    return torch.randn(2, t, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t", [1, 5, 20, 47])
@pytest.mark.parametrize("local", [0, 1, 2])
def test_sparse_equals_dense_mask_reference(t, local):
    """Forward, input gradient and every parameter gradient (fp32), at lengths inside one block,
    a few blocks and many; the indexer has no gradient (its output is a selection)."""
    # (abs_floor: one key, where the query's gradient is 0 and the reference's is rounding noise)
    check_sparse_equals_dense("B", model(dataclasses.replace(INDEX, local_blocks=local)), x_of(t, t), REL,
                              abs_floor=1e-8)


def test_tiled_selection_equals_naive_pooling(monkeypatch):
    """The selection made in passes of a few query rows (block ids from each row's first token)
    equals transformers' whole-matrix pooling, and keeps fewer keys than a dense attention."""
    from megamoe.layers.mixers import block_sparse as bs

    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn(2, 30, 2, 8, generator=gen), torch.randn(2, 41, 8, generator=gen)
    table = bs.block_table(2, 41, 4)
    monkeypatch.setattr(bs, "tile_rows", lambda n, queries=0: 7)
    for local in (0, 1, 3):
        got = bs.select_blocks(q, keys, table, torch.arange(11, 41), 5, local, 4)
        assert torch.equal(got, bs.naive_block_selection(q, keys, 5, local, 4)), local
    tok = bs.selection_tokens(got, table, torch.arange(11, 41), 4)
    assert ((tok >= 0).sum(-1) <= 20).all() and (tok[:, -1] >= 0).sum() < 2 * 2 * 41


@pytest.mark.parametrize("prefill", [0, 7])
def test_decoding_equals_full_forward(prefill):
    mixer = build_mixer("B", model())
    x = x_of(5, t=17)
    with torch.no_grad():
        assert rel_err(decode_steps(mixer, x, prefill), full_forward(mixer, x)) <= REL


def test_left_padded_rows_equal_each_prompt_alone():
    """Blocks start at each row's first real token: a row left-padded in a batch decodes as the
    prompt alone (padded queries see only themselves)."""
    from megamoe.layers.cache.decode import InferenceCache

    mixer = build_mixer("B", model())
    x = x_of(6, t=14)
    pad = torch.tensor([0, 5])
    with torch.no_grad():
        cache = InferenceCache(2, pad=pad)
        got = mixer(x, ForwardInfo(positions=cache.positions(14), cache=cache))
        cache.advance(14)
        for row, p in enumerate(pad.tolist()):
            alone = full_forward(mixer, x[row:row + 1, p:])
            assert rel_err(got[row:row + 1, p:], alone) <= REL, row


def test_packed_documents_equal_documents_one_by_one():
    mixer = build_mixer("B", model())
    x = x_of(7, t=19)
    documents = torch.tensor([[0] * 8 + [1] * 11, [0] * 13 + [1] * 6])
    with torch.no_grad():
        got = mixer(x, ForwardInfo(positions=torch.arange(19).expand(2, -1), documents=documents))
        for row in range(2):
            n = int((documents[row] == 0).sum())
            for a, b in ((0, n), (n, 19)):
                assert rel_err(got[row:row + 1, a:b], full_forward(mixer, x[row:row + 1, a:b])) <= REL


def test_matches_minimax_m3_sparse_attention():
    """transformers' MiniMaxM3VLAttention of a minimax_m3_sparse layer (eager, Gemma QK-norms,
    half of each head rotated), same weights: fp32 max abs <= 1e-5."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m

    hf_cfg = m.MiniMaxM3VLTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5}, index_n_heads=2, index_head_dim=8, index_block_size=3,
                                     index_topk_blocks=2, index_local_blocks=1, num_hidden_layers=1,
                                     layer_types=["minimax_m3_sparse"], rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    hf = m.MiniMaxM3VLAttention(hf_cfg, 0)
    randomize(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.sub_(1.0)  # Gemma norms store weight - 1
    ours = build_mixer("B", model(partial_rotary_factor=0.5))
    q = hf.q_proj.weight.view(2, 2 * 8, -1)
    k, v = (w.view(2, 8, -1) for w in (hf.k_proj.weight, hf.v_proj.weight))
    qkv = torch.cat([q, k, v], dim=1).reshape(-1, 32)
    names = {"linear_qkv.weight": None, "linear_proj.weight": "o_proj.weight", "q_norm.weight": "q_norm.weight",
             "k_norm.weight": "k_norm.weight", "indexer.linear_q.weight": "indexer.q_proj.weight",
             "indexer.linear_k.weight": "indexer.k_proj.weight", "indexer.q_norm.weight": "indexer.q_norm.weight",
             "indexer.k_norm.weight": "indexer.k_norm.weight"}
    load_from_hf(ours, hf, names)
    with torch.no_grad():
        ours.linear_qkv.weight.copy_(qkv)
    x = x_of(8, t=17)
    pos = torch.arange(17)[None].expand(2, -1)
    rope = m.MiniMaxM3VLRotaryEmbedding(hf_cfg)
    with torch.no_grad():
        want = hf(x, position_embeddings=rope(x, pos), attention_mask=causal_additive_mask(2, 17), position_ids=pos)[0]
        assert want.abs().max() > 0.1
        assert max_abs(full_forward(ours, x), want) <= 1e-5


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_equals_tp1(pool, sp):
    """Heads and KV groups split over two ranks, the indexer's query heads with them."""
    errs_all = pool(2).run(mixer_tp_case, "B", sp, model={"attention": model().attention, "layout": "BdAd"})
    for rank, errs in enumerate(errs_all):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: {bad}"
    assert sum(k.startswith("grad ") for k in errs_all[0]) >= 4


@pytest.mark.parametrize("docs", [False, True], ids=["cp2", "cp2-docs"])
def test_cp2_equals_single_process(pool, docs):
    """Indexer keys, keys and values all-gathered over CP; each rank selects and attends for its
    own queries (global positions, packed documents): outputs and every gradient (rel 1e-5)."""
    from tests.test_cp_softmax import check, cp_case

    check(pool(2).run(cp_case, "B", 2, docs=docs, model={"attention": model().attention, "layout": "BdAd"}),
          f"B cp=2 docs={docs}")
