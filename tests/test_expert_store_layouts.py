"""Tiered experts under pipeline parallelism and activation recompute: a LoRA fine-tune with
the experts in a store on disk gives the all-resident single-process loss curve (gloo, fp32,
<= 1e-6), at PP=2 (each stage's store holds its own layers) and with ``train.recompute``."""
from __future__ import annotations

import pytest

from tests.test_expert_store import experts_bytes, finetune, moe_heavy_config, write_store

STEPS = 3


def pp_curve(store: str, log_dir: str, budget_mib: float) -> dict:
    return finetune(store, log_dir, budget_mib, {"pp": 2}, steps=STEPS)


def test_tiered_experts_at_pp2_match_one_process(pool, tmp_path):
    cfg = moe_heavy_config(hidden=64, experts=8, ffn=64)
    store = write_store(cfg, tmp_path / "store")
    one = finetune(store, str(tmp_path / "one"), None, steps=STEPS)["losses"]
    runs = pool(2).run(pp_curve, store, str(tmp_path / "pp2"), experts_bytes(cfg) / 8 / 2**20)
    losses = [r["losses"] for r in runs if r["losses"]]
    assert losses, runs
    for curve in losses:
        assert len(curve) == STEPS and max(abs(a - b) for a, b in zip(one, curve)) <= 1e-6, (one, curve)
    assert all(r["stats"]["misses"] > 0 for r in runs), [r["stats"] for r in runs]  # both stages read experts


@pytest.mark.parametrize("parts", [["layer"], ["mlp"]])
def test_tiered_experts_with_recompute_match_resident(tmp_path, parts):
    cfg = moe_heavy_config(hidden=64, experts=8, ffn=64)
    store = write_store(cfg, tmp_path / "store")
    resident = finetune(store, str(tmp_path / "resident"), None, steps=STEPS)["losses"]
    tiered = finetune(store, str(tmp_path / "tiered"), experts_bytes(cfg) / 8 / 2**20, steps=STEPS,
                      recompute=parts)
    assert len(tiered["losses"]) == STEPS, tiered
    assert max(abs(a - b) for a, b in zip(resident, tiered["losses"])) <= 1e-6, (resident, tiered["losses"])
    assert tiered["stats"]["misses"] > 0, tiered["stats"]
