"""Per-layer parameter budgets of L, M, D, I equal the formulas in docs/mixers.md (meta builds)."""
from __future__ import annotations

from megamoe.planning.plan import budget
from tests.mixer_utils import tiny_model


def mixer_budget(letter: str) -> int:
    cfg = tiny_model(f"{letter}n")
    return budget(cfg).parts["layers.0"][0] - cfg.hidden_size  # minus the input norm


def test_budgets_match_doc_formulas():
    cfg = tiny_model()
    h = cfg.hidden_size
    lt, m, ix = cfg.lightning, cfg.mla, cfg.mla.indexer
    width = lt.num_heads * lt.dim(h)
    assert mixer_budget("L") == 5 * h * width + width
    H, dq = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    mla = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * dq
           + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
           + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim) + H * m.v_head_dim * h)
    assert mixer_budget("M") == mla
    indexer = m.q_lora_rank * ix.num_heads * ix.head_dim + h * ix.head_dim + 2 * ix.head_dim + h * ix.num_heads
    assert mixer_budget("D") == mla + indexer
    assert mixer_budget("I") == mla + indexer + ix.kpool * ix.head_dim + ix.head_dim * h
