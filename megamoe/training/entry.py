"""What tools/pretrain.py and tools/finetune.py run: a recipe (``megamoe.recipe.load_train_recipe``)
-> data -> Trainer.fit()."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Sequence

from megamoe.core.config_io import to_yaml
from megamoe.training.run_folders import RunFolders

log = logging.getLogger(__name__)


def weights_source(recipe) -> Path | None:
    """Where a run's starting weights come from: ``checkpoint.load``, else the checkpoint it resumes."""
    from megamoe.checkpoint.dcp import latest_checkpoint

    c = recipe.checkpoint
    if c.load:
        return Path(c.load)
    return latest_checkpoint(c.dir) if c.dir and c.resume else None


def adopt_checkpoint_model(recipe, overrides: Sequence[str] = ()) -> None:
    """Fine-tuning: the model is the one the weights were saved with (meta.json's ``model``),
    so ``checkpoint.load=DIR`` alone is enough; ``model.*`` overrides on the command line still
    apply on top, and the resume guards then refuse any that differs from the checkpoint."""
    from omegaconf import OmegaConf

    from megamoe.core.config_io import config_from_dict, config_to_dict
    from megamoe.checkpoint.dcp import read_meta
    from megamoe.checkpoint.open import Checkpoint
    from megamoe.training.guards import changed_fields

    source = weights_source(recipe)
    meta = read_meta(source) if source is not None else {}
    if "model" not in meta:
        return
    Checkpoint(source, meta).config  # noqa: B018  (checks the model against the weights on disk, allocating nothing)
    mine = OmegaConf.from_dotlist([o for o in overrides if o.startswith("model.")]).get("model", {})
    model = config_from_dict(OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(meta["model"]), mine)))
    differs = [f for f, _, _ in changed_fields(config_to_dict(recipe.model), config_to_dict(model), "model")]
    if recipe.model.moe is not None and model.moe is not None:  # where experts are kept is the run's choice
        model.moe.expert_store = recipe.model.moe.expert_store
    recipe.model = model
    recipe.validate()
    log.info("model from %s%s", source, f" (the recipe's model section differed in {', '.join(differs)})"
             if differs else "")


def run_training(recipe) -> dict:
    """Build tokenizer, dataset and trainer from ``recipe`` and train; returns a summary
    (last metrics and where the logs and checkpoints went) on every rank."""
    log_dir = recipe.logging.dir or (str(Path(recipe.checkpoint.dir) / "tb") if recipe.checkpoint.dir else "runs")
    # global rank 0 (torchrun's RANK, before the process group exists) holds checkpoint.dir
    with RunFolders(recipe.checkpoint.dir, log_dir, holder=os.environ.get("RANK", "0") == "0") as folders:
        trainer, history = _train(recipe, log_dir, folders)
    last = history[-1] if history else {}
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]
    return {"trainer": trainer, "log_dir": log_dir, "checkpoint_dir": recipe.checkpoint.dir,
            "first_loss": history[0]["loss"] if history else None, "last": last, "steps": trainer.step,
            "eval_loss": evals[-1] if evals else None}


def _train(recipe, log_dir: str, folders: RunFolders):
    """(trainer, per-step history): tokenizer, data, the trainer, its record in ``log_dir``, fit."""
    from megamoe.data import build_datasets, build_tokenizer, check_vocab
    from megamoe.training.trainer import Trainer, meta_tower

    tokenizer = build_tokenizer(recipe.data)
    check_vocab(tokenizer, recipe.model.vocab_size)
    # the data is opened and its records checked before a process group or a weight exists; image
    # captions need the tower's count of placeholder tokens per image (from the config alone)
    vision = recipe.model.vision
    image_tokens = meta_tower(recipe.model).image_tokens if vision is not None else None
    dataset, valid = build_datasets(recipe.data, tokenizer, image_tokens, recipe.eval.paths, recipe.eval.split,
                                    image_bounds=vision.bounds if vision is not None else None)
    trainer = Trainer(recipe)
    start = trainer.step  # a resumed run's step: a failure before it moves on leaves nothing new
    folders.trained = lambda: trainer.step > start
    if trainer.rank == 0:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / "recipe.yaml").write_text(to_yaml(recipe))
        log.info("training %d steps on %d ranks (%s); logs in %s", recipe.train.steps, trainer.world,
                 trainer.groups.describe(), log_dir)
    return trainer, trainer.fit(log_dir, dataset, valid)


def finish(summary: dict) -> None:
    """What a training command prints at the end (rank 0), then the process group goes."""
    import torch.distributed as dist

    if summary["trainer"].rank == 0:
        print(done_line(summary))
        print(f"TensorBoard logs: {summary['log_dir']}  (tensorboard --logdir {summary['log_dir']})")
        if summary["checkpoint_dir"]:
            print(f"checkpoints: {summary['checkpoint_dir']}")
    if dist.is_initialized():
        dist.destroy_process_group()


def done_line(summary: dict) -> str:
    """The closing line of a training command."""
    if summary["first_loss"] is None:
        return f"done: the checkpoint is at step {summary['steps']}, which train.steps does not exceed; nothing trained"
    last = summary["last"].get("loss", float("nan"))
    line = f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> {last:.4f}"
    if summary.get("eval_loss") is not None:
        line += f", validation loss {summary['eval_loss']:.4f} (perplexity {math.exp(min(summary['eval_loss'], 700)):.2f})"
    return line
