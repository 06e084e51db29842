"""TP=2 equals TP=1 for every attention mixer (A, S, L, M, D, I), with and without sequence
parallelism: outputs, input gradients, every parameter gradient (gloo, 2 processes)."""
from __future__ import annotations

import pytest

from tests.mixer_utils import mixer_tp_case, tiny_model
from tests.test_tensor_parallel import tp_parity_case

REL = 1e-5


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("letter", ["A", "S", "L", "M", "D", "I"])
def test_mixer_tp2_equals_tp1(pool, letter, sp):
    results = pool(2).run(mixer_tp_case, letter, sp)
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"{letter} rank {rank}: relative errors over {REL}: {bad}"
    assert sum(k.startswith("grad ") for k in results[0]) >= 4  # the gradients were compared


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_mla_without_query_latent_with_head_gate_tp2_equals_tp1(pool, sp):
    """Kimi/Ling-style M: q projected from x (column-parallel, SP-gathered), per-head gate."""
    mla = dict(q_lora_rank=None, indexer=None, head_gate=True, rope="half")
    for rank, errs in enumerate(pool(2).run(mixer_tp_case, "M", sp, mla=mla)):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"
    assert "grad linear_gate.weight" in errs and "grad linear_q.weight" in errs


def test_hybrid_model_tp2_equals_tp1(pool):
    """A whole LM interleaving every mixer: logits, loss and all gradients after finalize_grads."""
    cfg = tiny_model("LdMdDdIdSdAd", tie_embeddings=True)
    for rank, errs in enumerate(pool(2).run(tp_parity_case, cfg, 2, True)):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"
