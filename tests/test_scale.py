"""Any config builds on the meta device; counts equal a hand count."""
from __future__ import annotations

from megamoe.recipe import load_recipe
from tests.presets import meta_budget


def hand_count_dense(m) -> int:
    a, h, L = m.attention, m.hidden_size, m.parsed_layout().num_layers
    d = a.head_dim or h // a.num_heads
    qkv = h * (a.num_heads * (2 if a.output_gate else 1) + 2 * a.kv_heads()) * d
    proj = a.num_heads * d * h
    qk_norm = 2 * d if a.qk_norm else 0
    mlp = 3 * h * m.mlp.ffn_hidden_size
    per_layer = qkv + proj + qk_norm + mlp + 2 * h
    embed = m.vocab_size * h * (1 if m.tie_embeddings else 2)
    return L * per_layer + embed + h


def test_tiny_dense_count_matches_hand_count():
    from megamoe.planning.plan import budget

    m = load_recipe("tiny_dense").model
    b = budget(m)
    assert b.total == hand_count_dense(m) and b.active == b.total


def test_100b_dense_builds_on_meta_fast_and_small():
    """A fresh process (so the RSS is the build's own): < 30 s, < 2 GiB, exact count."""
    out = meta_budget("dense_105b")
    m = load_recipe("dense_105b").model
    assert out["total"] == hand_count_dense(m) > 100e9
    assert out["seconds"] < 30, out
    assert out["rss_mib"] < 2048, out
