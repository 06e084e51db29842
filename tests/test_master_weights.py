"""bf16 parameters with fp32 master weights, and optimizer-state offload (training/optimizer.py)."""
from __future__ import annotations

import torch

from megamoe.core.config import ParallelConfig
from megamoe.parallel.groups import ParallelGroups
from megamoe.training.config import OptimConfig
from megamoe.training.optimizer import DistributedOptimizer


def _adam(params, offload=False, lr=1e-4):
    cfg = OptimConfig(lr=lr, min_lr=lr, warmup_steps=0, weight_decay=0.0, zero1=False)
    return DistributedOptimizer(list(params.items()), ParallelGroups(), cfg, offload=offload)


def test_updates_below_half_a_bf16_step_accumulate_in_the_master():
    """Adam moves a weight of 1.0 by ~lr = 1e-4 per step, under half of bf16's step at 1.0
    (2^-7): without a master the bf16 weight would never move. After 100 steps the fp32
    master holds 1 - 100 lr and the weight is its bf16 rounding."""
    w = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    opt = _adam({"w": w})
    for _ in range(100):
        w.grad = torch.ones_like(w)
        opt.step(1e-4)
        opt.zero_grad()
    master = opt.masters[w]
    assert master.dtype == torch.float32
    # fp32 rounding at 1.0 (6e-8 per step) and Adam's eps keep it within 1e-5 of the exact sum
    torch.testing.assert_close(master, torch.full((4, 4), 1 - 100 * 1e-4), rtol=0, atol=1e-5)
    assert torch.equal(w, master.to(torch.bfloat16)) and (w < 1).all()
    states = opt.owned_states()["w"][1]
    assert states["master"] is master and states["exp_avg"].dtype == torch.float32


def test_offloaded_update_equals_the_resident_one_bitwise():
    torch.manual_seed(0)
    init = torch.randn(8, 8)
    a, b = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    resident, offloaded = _adam({"w": a}), _adam({"w": b}, offload=True)
    for step in range(5):
        g = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        for p, opt in ((a, resident), (b, offloaded)):
            p.grad = g.clone()
            opt.step(1e-2)
            opt.zero_grad()
    assert torch.equal(a, b)
    assert offloaded.masters[b].device.type == "cpu" and "master" not in offloaded.owned_states()["w"][1]


def bf16_run(root: str, steps: int, offload: bool, resume_at: int | None = None) -> list[float]:
    """The tiny hybrid MoE with bf16 parameters (and optionally offloaded states); with
    ``resume_at`` it stops there, saves, and a new trainer resumes to ``steps``."""
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer
    from tests.test_trainer_parity import tiny_recipe

    def trainer(n):
        recipe = tiny_recipe(ParallelConfig(), steps=n, optimizer_offload=offload)
        recipe.model.params_dtype = "bfloat16"
        recipe.optim.lr = 1e-3
        recipe.checkpoint.dir = root
        return Trainer(recipe, SyntheticDataset(64, 16, seed=3))

    if resume_at is None:
        return [m["loss"] for m in trainer(steps).fit(root + "/tb")]
    first = [m["loss"] for m in trainer(resume_at).fit(root + "/tb")]
    return first + [m["loss"] for m in trainer(steps).fit(root + "/tb")]


def test_bf16_training_resumes_bitwise_with_its_masters(pool, tmp_path):
    """bf16 parameters train (the loss falls), offload changes nothing, and a resumed run
    continues bitwise: the checkpoint carries the fp32 masters, not only the bf16 weights."""
    full = pool(1).run(bf16_run, str(tmp_path / "a"), 8, False)[0]
    offload = pool(1).run(bf16_run, str(tmp_path / "b"), 8, True)[0]
    resumed = pool(1).run(bf16_run, str(tmp_path / "c"), 8, False, 4)[0]
    assert full[-1] < full[0]
    assert offload == full
    assert resumed == full
