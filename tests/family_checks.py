"""Checks a converted family must pass beyond the round trip of tests/conversion_harness.py
(used by tests/test_convert_glm5_minimax_m.py):

- every parameter's gradient equals transformers' (the HF gradients taken through the family's
  own mapping table, which is linear in the tensors: concatenations, splits and stackings);
- a parallel layout (TP=2 x EP=2, CP=2) of the imported model equals one process: loss, logits
  and every gradient (rel 1e-5);
- 50 LoRA steps through the trainer lower the loss and leave every router bitwise unchanged.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from tests.numerics import rel_err

GRAD_REL = 1e-5  # the tolerance of the other families' gradient checks (tests/test_moe_hf.py, test_dsa.py)


def batch(vocab: int, seq: int = 12, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [2, seq], a fixed cotangent of the logits [2, seq, vocab])."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (2, seq), generator=gen), torch.randn(2, seq, vocab, generator=gen)


def hf_gradient_errors(hf_model, hf_dir: Path, ids: torch.Tensor, cotangent: torch.Tensor, **inputs) -> dict:
    """{megamoe parameter: relative error of its gradient against transformers'} for the loss
    sum(logits * cotangent), plus ``logits``. ``inputs``: extra model inputs (images) as
    (megamoe kwargs, transformers kwargs) under the keys ``ours`` and ``hf``."""
    from megamoe.convert import from_hf
    from megamoe.convert.api import open_hf, plan_entries

    hf_model = hf_model.float().train()
    ours = from_hf(hf_dir).train()
    hf_logits = hf_model(input_ids=ids, **inputs.get("hf", {})).logits
    (hf_logits * cotangent).sum().backward()
    logits = ours(ids, **inputs.get("ours", {}))
    (logits * cotangent).sum().backward()
    hf_params = dict(hf_model.named_parameters())
    _, family, cfg = open_hf(hf_dir)
    errs = {"logits": (logits - hf_logits).abs().max().item()}
    params = dict(ours.named_parameters())
    for entry in plan_entries(family, cfg, hf_model.config.to_dict(), set(hf_params)):
        mine = params.get(entry.mm)
        if mine is None or not mine.requires_grad or any(n not in hf_params for n in entry.hf):
            continue  # buffers, and the expert bias (a frozen parameter here, a buffer in transformers)
        theirs = [hf_params[n].grad for n in entry.hf]
        if mine.grad is None or any(g is None for g in theirs):  # the indexers: no gradient on either side
            errs[entry.mm] = 0.0 if mine.grad is None and all(g is None for g in theirs) else 1.0
            continue
        errs[entry.mm] = rel_err(mine.grad, entry.to_mm(theirs))
    return errs


def assert_gradients_match(errs: dict) -> None:
    assert errs.pop("logits") <= 1e-4
    bad = {k: v for k, v in errs.items() if v > GRAD_REL}
    assert not bad, bad


# ---- a parallel layout against one process ----------------------------------------------------

def parallel_grads_case(hf_dir: str, parallel: dict | None, ids: torch.Tensor, sp: bool = False) -> dict:
    """Loss, logits and every gradient (full size) of one training forward of the HF checkpoint
    imported for ``parallel`` (None: one process)."""
    from megamoe.core.config import ParallelConfig
    from megamoe.convert import from_hf
    from megamoe.model.language_model import shift_labels
    from megamoe.parallel.groups import ParallelGroups, build_groups
    from megamoe.parallel.sharding import gather_full
    from megamoe.training.grads import sync_grads

    groups = build_groups(ParallelConfig(**parallel)) if parallel else ParallelGroups()
    model = from_hf(hf_dir, groups, sequence_parallel=sp).train()
    labels = shift_labels(ids)
    loss = model(ids, labels=labels)
    loss.backward()
    sync_grads([model], groups)
    model.eval()
    with torch.no_grad():
        logits = model(ids)
    shard = model.sequence_shard(ids.size(1))
    if shard is not None:
        logits = shard.gather(logits, 1)
    grads = {n: gather_full(p, groups, p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "logits": logits, "grads": grads}


def assert_parallel_equals_single(got: dict, ref: dict, what: str) -> None:
    assert rel_err(got["loss"], ref["loss"]) <= 1e-6, (what, got["loss"], ref["loss"])
    assert rel_err(got["logits"], ref["logits"]) <= 1e-5, what
    assert got["grads"].keys() == ref["grads"].keys(), what
    bad = {n: rel_err(got["grads"][n], g) for n, g in ref["grads"].items() if rel_err(got["grads"][n], g) > 1e-5}
    assert not bad, (what, bad)


# ---- LoRA through the trainer -----------------------------------------------------------------

def lora_case(ckpt: str, log_dir: str, steps: int = 50) -> dict:
    """``steps`` LoRA steps (every linear role and the routed experts adapted) from a converted
    checkpoint: the losses, and whether every router's weight and bias stayed bitwise the same
    after every step."""
    from megamoe.core.config import ParallelConfig
    from megamoe.data import DataConfig
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.lora import LoRAConfig
    from megamoe.model.moe_controls import routers
    from megamoe.core.config_io import config_from_dict
    from megamoe.checkpoint.dcp import read_meta
    from megamoe.training.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig
    from megamoe.training.trainer import Trainer
    from megamoe.recipe import Recipe as TrainRecipe

    model = config_from_dict(read_meta(ckpt)["model"])
    recipe = TrainRecipe(model=model, parallel=ParallelConfig(), data=DataConfig(kind="synthetic", seq_len=16),
                         train=TrainConfig(steps=steps, micro_batch_size=2, global_batch_size=2, seed=3),
                         optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.0),
                         checkpoint=CheckpointConfig(load=ckpt),
                         logging=LoggingConfig(progress=False, latency_interval=0), lora=LoRAConfig(rank=4))
    vocab = model.vocab_size if model.vision is None else min(model.vocab_size, model.vision.image_token_id)
    with contextlib.redirect_stdout(io.StringIO()):  # (text only: no image placeholder in the samples)
        trainer = Trainer(recipe, SyntheticDataset(vocab, 16, seed=5))
    chunk = trainer.chunks[0]
    frozen = [(r.weight.detach().clone(), None if r.expert_bias is None else r.expert_bias.detach().clone())
              for r in routers(chunk)]
    seen = {"routers": True}

    def watch(step):
        for (w, b), r in zip(frozen, routers(chunk)):
            seen["routers"] &= torch.equal(w, r.weight) and (b is None or torch.equal(b, r.expert_bias))

    trainer.after_step_hooks.append(watch)
    history = trainer.fit(log_dir)
    losses = [h["loss"] for h in history]
    return {"losses": losses, "routers_bitwise_same": seen["routers"], "routers": len(frozen)}


def assert_lora_trains(result: dict) -> None:
    losses = result["losses"]
    assert len(losses) == 50 and result["routers"] > 0 and result["routers_bitwise_same"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
