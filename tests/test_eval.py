"""Validation during training (the ``eval`` section): the loss of held-out data at every parallel
layout equals one process, never reads a training token, reaches TensorBoard and metrics.jsonl,
and ``eval.save_best`` keeps the checkpoint of the lowest validation loss."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megamoe.core.config import ParallelConfig
from megamoe.training.config import EvalConfig
from tests.test_trainer_parity import tiny_recipe

STEPS, EVERY, ITERS, SPLIT = 4, 2, 2, 0.25
TOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A Megatron indexed dataset (megatron-core's builder) of ids the tiny model's vocabulary holds."""
    from tests.test_data_blend import megatron_builder

    prefix = tmp_path_factory.mktemp("eval") / "corpus"
    rng = np.random.default_rng(0)
    docs = [np.append(6 + (rng.integers(0, 8) + 3 * np.arange(int(rng.integers(8, 30)))) % 58, 2) for _ in range(60)]
    megatron_builder(prefix, [d.astype(np.int64) for d in docs], np.uint16)
    return str(prefix)


def eval_case(parallel: ParallelConfig, corpus: str, log_dir: str, ckpt_dir: str | None = None) -> dict:
    """Train the tiny hybrid MoE 4 steps on the corpus less its held-out quarter, evaluating at
    steps 2 and 4; returns the validation losses and the token ranges read for training and for
    validation."""
    from megamoe.data import ByteTokenizer, DataConfig, PackedDataset, build_datasets
    from megamoe.training.trainer import Trainer

    recipe = tiny_recipe(parallel, steps=STEPS)
    recipe.data = DataConfig(kind="pretrain", paths=[corpus], seq_len=16, seed=5)
    recipe.eval = EvalConfig(interval=EVERY, iters=ITERS, split=SPLIT, save_best=ckpt_dir is not None)
    recipe.checkpoint.dir = ckpt_dir
    train, valid = build_datasets(recipe.data, ByteTokenizer(), eval_split=SPLIT)
    read = {"train": [], "valid": []}
    window = PackedDataset.window

    def logged(self, index):  # which token range each dataset hands out
        st = self.streams[0]
        begin = st.begin + index * self.seq_len
        read["valid" if self is valid else "train"].append((begin, begin + self.seq_len + 1))
        return window(self, index)

    PackedDataset.window = logged
    try:
        trainer = Trainer(recipe, train)
        history = trainer.fit(log_dir, train, valid)
    finally:
        PackedDataset.window = window
    out = {"eval": [(i + 1, h["eval_loss"], h["eval_ppl"]) for i, h in enumerate(history) if "eval_loss" in h],
           "read": read, "best": trainer.best_eval_loss}
    if parallel == ParallelConfig(pp=1):  # one process: the last evaluation by hand, from the model
        out["by_hand"] = loss_by_hand(trainer, valid)
    return out


def loss_by_hand(trainer, valid) -> float:
    """Mean token loss of the first ITERS global batches of the validation order, one forward of
    the trained model over all of them."""
    from megamoe.data.loader import sample_items

    g = trainer.train.global_batch_size
    items = sample_items(valid, np.arange(ITERS * g), trainer.recipe.data.seed, True)
    ids = torch.stack([valid[int(i)]["input_ids"] for i in items])
    labels = torch.stack([valid[int(i)]["labels"] for i in items])
    with torch.no_grad():
        logits = trainer.chunks[0](ids)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).double(), labels.reshape(-1)).item()


@pytest.fixture(scope="module")
def single(pool, corpus, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("single")
    out = pool(1).run(eval_case, ParallelConfig(pp=1), corpus, str(root / "tb"), str(root / "ckpt"))[0]
    out["root"] = root
    return out


def test_eval_loss_by_hand_and_reads_no_training_token(single):
    steps = [s for s, _, _ in single["eval"]]
    assert steps == [2, 4]
    assert abs(single["eval"][-1][1] - single["by_hand"]) <= 1e-6 * single["by_hand"], (single["eval"], single["by_hand"])
    for _, loss, ppl in single["eval"]:
        assert math.isclose(ppl, math.exp(loss), rel_tol=1e-12)
    train, valid = single["read"]["train"], single["read"]["valid"]
    per_eval = ITERS * 8  # global batches of 8
    assert len(valid) == 2 * per_eval and len(train) == STEPS * 8
    assert max(end for _, end in train) <= min(begin for begin, _ in valid)  # validation lies past every training token
    assert valid[:per_eval] == valid[per_eval:]  # both evaluations read the same samples, in the same order


def test_eval_logged_and_best_checkpoint_kept(single):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megamoe.checkpoint.dcp import latest_checkpoint, read_meta
    from megamoe.training.entry import done_line

    root = single["root"]
    acc = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, col in (("eval/loss", 1), ("eval/ppl", 2)):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [2, 4]
        assert all(math.isclose(e.value, x[col], rel_tol=1e-6) for e, x in zip(events, single["eval"]))
    lines = [json.loads(x) for x in (root / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["eval_loss"]) for x in lines if "eval_loss" in x] == [(s, v) for s, v, _ in single["eval"]]
    best_step, best = min(((s, v) for s, v, _ in single["eval"]), key=lambda x: x[1])
    ckpt = latest_checkpoint(root / "ckpt" / "best")
    state = read_meta(ckpt)["trainer_state"]
    assert state["step"] == best_step and state["best_eval_loss"] == best == single["best"]
    assert latest_checkpoint(root / "ckpt").name == f"step_{STEPS:08d}"  # the run's own checkpoints go on
    line = done_line({"steps": 4, "first_loss": 4.0, "last": {"loss": 3.0}, "eval_loss": 2.0})
    assert line.endswith(f"validation loss 2.0000 (perplexity {math.exp(2.0):.2f})")


LAYOUTS = {"tp2": ParallelConfig(tp=2, sequence_parallel=True), "pp2": ParallelConfig(pp=2),
           "cp2": ParallelConfig(cp=2), "ep2": ParallelConfig(ep=2)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eval_loss_at_parallel_layouts_equals_one_process(pool, single, corpus, name, tmp_path):
    runs = pool(2).run(eval_case, LAYOUTS[name], corpus, str(tmp_path / "tb"))
    assert runs[0]["eval"] == runs[1]["eval"]  # every rank reports the same value
    got, want = [x[1] for x in runs[0]["eval"]], [x[1] for x in single["eval"]]
    assert len(got) == len(want) == 2
    diff = max(abs(a - b) / b for a, b in zip(got, want))
    assert diff <= TOL, f"{name}: validation loss {got} differs from one process {want} by {diff:.2e}"


def test_eval_config_errors_are_one_line():
    from megamoe.core.errors import ConfigError
    from megamoe.recipe import load_recipe

    for overrides, message in ((["eval.interval=5"], "eval.interval=5 is invalid: needs validation data"),
                               (["eval.split=1.5"], "eval.split=1.5 is invalid: must be in [0, 1)"),
                               (["eval.split=0.1", "eval.paths=[a]"], "eval.split=0.1 is invalid: validation data "
                                                                      "comes from eval.paths or eval.split"),
                               (["eval.interval=5", "eval.split=0.1", "eval.save_best=true", "checkpoint.dir=null"],
                                "eval.save_best=True is invalid: needs checkpoint.dir")):
        recipe = load_recipe("tiny_train", overrides)
        with pytest.raises(ConfigError) as e:
            recipe.validate()
        assert str(e.value) == message or str(e.value).startswith(message), str(e.value)
