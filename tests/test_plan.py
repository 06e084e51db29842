"""The planner's per-rank memory (megamoe/planning/plan.py) against what real trainer ranks hold.

For each layout the trainer runs one step; each rank sums the bytes of its parameters, of the
gradients backward produced (read just before they are cleared) and of its optimizer state
(moments, fp32 masters); the planner's figures for that rank's stages must match within 15%
(they are in fact exact: the static memory is determined by the shapes, dtypes, sharding
rules and ZeRO-1 ownership). The whole per-rank peak, activations included, is checked
against measured peaks in tests/test_plan_measured.py."""
from __future__ import annotations

import pytest

from megamoe.core.config import ParallelConfig

LAYOUTS = {
    "dp2": ({}, False, "float32"),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, False, "float32"),
    "pp2": ({"pp": 2}, False, "float32"),
    "ep2": ({"ep": 2}, False, "float32"),
    "dp2-bf16": ({}, False, "bfloat16"),
    "tp2-lora": ({"tp": 2}, True, "float32"),
}


def measured_case(parallel: dict, lora: bool, dtype: str) -> dict:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.lora import LoRAConfig
    from megamoe.planning.plan import stage_memory
    from megamoe.training.trainer import Trainer
    from tests.test_trainer_parity import tiny_recipe

    recipe = tiny_recipe(ParallelConfig(**parallel), steps=1)
    recipe.model.params_dtype = dtype
    if lora:
        recipe.lora = LoRAConfig(rank=4, targets=["*"])
    trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
    grads = []
    clear = trainer.optimizer.zero_grad

    def counting_zero_grad():
        grads.append(sum(p.grad.numel() * p.grad.element_size() for p in trainer.optimizer.params
                         if p.grad is not None))
        clear()

    trainer.optimizer.zero_grad = counting_zero_grad
    trainer.fit("/tmp/megamoe_test_plan_tb")
    params = [p for c in trainer.chunks for p in c.parameters()]
    optim = sum(t.numel() * t.element_size() for _, (_, state) in trainer.optimizer.owned_states().items()
                for k, t in state.items() if k != "step")
    planned = stage_memory(recipe.model, recipe.parallel, trainer.world, recipe.train.micro_batch_size,
                           recipe.data.seq_len, lora=recipe.lora, zero1=recipe.optim.zero1)
    mine = [planned[i] for i in trainer.stage_ids]
    return {"weights": (sum(p.numel() * p.element_size() for p in params), sum(r["weights"] for r in mine)),
            "grads": (max(grads), sum(r["grads"] for r in mine)),
            "optimizer": (optim, sum(r["optim"] for r in mine))}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_static_memory_matches_the_ranks(pool, name):
    parallel, lora, dtype = LAYOUTS[name]
    for rank, result in enumerate(pool(2).run(measured_case, parallel, lora, dtype)):
        for what, (measured, planned) in result.items():
            assert measured > 0 and abs(planned - measured) <= 0.15 * measured, (name, rank, what, measured, planned)


def gpu_mem_rows(*overrides: str) -> tuple[str, list[tuple[str, float]]]:
    """``megamoe-plan --config hybrid_vl_1t --world-size 256 --gpu-mem 141GiB``: the heading and
    the (layout, busiest rank's GiB) rows it prints."""
    import contextlib
    import io

    from megamoe.commands.plan import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--config", "hybrid_vl_1t", "--world-size", "256", "--gpu-mem", "141GiB", *overrides])
    lines = out.getvalue().splitlines()
    head = next(line for line in lines if line.startswith("layouts of"))
    rows = [line.split("   busiest rank ") for line in lines if line.strip().startswith("parallel.tp=")]
    return head, [(layout.strip(), float(gib.split()[0])) for layout, gib in rows]


def test_gpu_mem_lists_fitting_layouts_for_the_1t_preset_lora_and_full_training():
    lora_head, lora = gpu_mem_rows("lora.rank=16", "lora.targets=[experts]")
    full_head, full = gpu_mem_rows()
    assert lora_head.startswith("layouts of 256 ranks (32 nodes of 8) that fit 141 GiB per device (LoRA")
    assert full_head.startswith("layouts of 256 ranks (32 nodes of 8) that fit 141 GiB per device (full training")
    for rows in (lora, full):
        assert rows and all(gib <= 141 for _, gib in rows)  # (ranked by step time: tests/test_step_time.py)
    # LoRA drops the frozen weights' gradients and optimizer states: the same layout needs less
    best = dict(full)
    assert all(gib < best[layout] for layout, gib in lora if layout in best) and set(best) & {k for k, _ in lora}
