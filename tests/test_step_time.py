"""The planner's step-time model: its bytes per group and step equal what the communication
monitor records in a real training step (4 gloo ranks) within 5% on three layouts (EP=2 x
expert-DP=2; TP=2 x EP=2 without SP; PP=2 x TP=2 with SP), and megamoe-plan --gpu-mem ranks layouts by estimated step time."""
from __future__ import annotations

import re

import pytest
import torch

from megamoe.core.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig, ParallelConfig
from tests.test_trainer_parity import tiny_recipe

LAYOUTS = [dict(ep=2), dict(tp=2, ep=2), dict(pp=2, tp=2, sequence_parallel=True)]  # on 4 ranks


def recipe_for(parallel: dict):
    """Softmax attention, a MoE layer with a shared expert and a dense one; 2 micro-batches per rank."""
    recipe = tiny_recipe(ParallelConfig(**parallel), steps=2)
    recipe.model = ModelConfig(vocab_size=64, hidden_size=32, layout="Ae|Ad" if parallel.get("pp") else "AeAd",
                               attention=AttentionConfig(num_heads=4, num_kv_heads=2),
                               mlp=MLPConfig(ffn_hidden_size=64),
                               moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=32, num_shared_experts=1))
    return recipe


def measured_bytes(layouts: list[dict]) -> list[dict[str, float]]:
    """Per layout: bytes per group this rank's collectives carried in one step (after a warm-up step)."""
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.parallel import comm
    from megamoe.training.trainer import Trainer

    out = []
    for parallel in layouts:
        trainer = Trainer(recipe_for(parallel))
        ds, b = SyntheticDataset(64, 16, seed=3), trainer.train.micro_batch_size
        micro = [{k: torch.stack([ds[m * b + i][k] for i in range(b)]) for k in ds[0]} for m in range(trainer.n_micro)]
        trainer.train_step(micro)
        rec = comm.LatencyRecorder()
        with rec.active():
            trainer.train_step(micro)
        got: dict[str, float] = {}
        for key, samples in rec.drain().items():
            group = comm.split_key(key)[1]
            got[group] = got.get(group, 0.0) + sum(n for _, n in samples)
        out.append(got)
    return out


def test_planned_bytes_equal_measured(pool):
    from megamoe.planning.traffic import by_group, step_bytes

    world = 4
    per_rank = pool(world).run(measured_bytes, LAYOUTS)
    for i, parallel in enumerate(LAYOUTS):
        planned = by_group(step_bytes(recipe_for(parallel), ParallelConfig(**parallel), world))
        groups = {g for r in per_rank for g in r[i]}
        assert groups == set(planned), f"{parallel}: measured groups {sorted(groups)}, planned {sorted(planned)}"
        for group in groups:  # the mean over ranks (all-to-all rows and stages differ between ranks)
            mean = sum(r[i].get(group, 0.0) for r in per_rank) / world
            assert planned[group] == pytest.approx(mean, rel=0.05), f"{parallel} {group}: {planned[group]} vs {mean}"


def test_plan_ranks_layouts_by_step_time(capsys):
    from megamoe.commands.plan import main

    main(["--config", "moe_1t", "--world-size", "64", "--gpu-mem", "1TiB", "--nodes", "8"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  parallel.tp=")]
    assert len(rows) >= 3
    steps = [float(line.split("step ")[1].split(" s")[0]) for line in rows]
    assert steps == sorted(steps) and all(re.search(r", comm \d+% \((ep|tp|edp|dp_cp) \d+%", line) for line in rows), rows


def test_step_time_by_hand():
    """Compute: 6 x active matmul parameters x tokens / world / rate; comm: bytes x bus factor / link."""
    from megamoe.model.params import count_parameters
    from megamoe.planning.plan import planned_model
    from megamoe.planning.step_time import Hardware, step_time
    from megamoe.planning.traffic import ep_bytes

    recipe, hw = recipe_for(dict(ep=4)), Hardware(tflops=1.0, intra_gbps=10.0, inter_gbps=1.0)
    b = count_parameters(planned_model(recipe.model))
    active = b.active - b.parts["embedding"][1]
    inside, across = (step_time(recipe, ParallelConfig(ep=4), 4, node, hw, act_bytes=4) for node in (4, 2))
    assert inside["compute"] == pytest.approx(6 * active * 8 * 16 / 4 / 1e12)
    a2a = ep_bytes(recipe, ParallelConfig(ep=4), 4, act_bytes=4) * 3 / 4  # bus factor (n-1)/n
    assert inside["comm"]["ep"] == pytest.approx(a2a / 10e9)
    assert across["comm"]["ep"] == pytest.approx(a2a * (0.5 / 10e9 + 0.5 / 1e9))  # half the peers on the other node
    assert 0 < inside["comm_share"] < across["comm_share"] < 1
