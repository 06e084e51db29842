"""Validation during training: the loss and perplexity of held-out data (``eval`` section).

Every ``eval.interval`` steps and at the last step the trainer runs ``eval.iters`` global
batches of validation data forward only (through the pipeline schedule when ``pp > 1``), on
every rank of the grid, with the model in eval mode and the MoE routers not recording (the
expert-bias update and the MoE metrics see training tokens only). The loss is the sum of token
losses over all those batches divided by their number of target tokens, reduced exactly as a
training step's loss is, so every parallel layout reports the single-process value;
``ppl = exp(loss)``.

Every evaluation reads the same samples: the first ``iters * train.global_batch_size`` of the
validation data's order (``data.seed``; a blend's weighted order), each data-parallel rank its
slice, so successive values compare like with like. With ``eval.save_best`` a checkpoint is
written to ``<checkpoint.dir>/best`` whenever the loss is the lowest so far (the best value is
part of the trainer state, so a resumed run keeps it).
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch

from megamoe.data import BatchLayout, TrainData
from megamoe.parallel import comm
from megamoe.parallel.cross_entropy import IGNORE_INDEX
from megamoe.training.config import EvalConfig

log = logging.getLogger(__name__)

BEST = "best"


class Evaluator:
    """The validation loop of one trainer (``trainer``: a ``megamoe.training.trainer.Trainer``)."""

    def __init__(self, trainer, dataset, cfg: EvalConfig):
        self.trainer, self.cfg = trainer, cfg
        t, data = trainer.train, trainer.recipe.data
        layout = BatchLayout(t.global_batch_size, t.micro_batch_size, trainer.dp, trainer.groups.rank("dp"))
        self.data = TrainData(dataset, layout, data.seed, data.shuffle, 0, num_workers=0)
        self.samples = cfg.iters * t.global_batch_size
        if trainer.rank == 0 and self.samples > len(dataset):
            log.warning("eval reads %d samples per evaluation but the validation data has %d: it repeats them "
                        "(reshuffled); lower eval.iters or add validation data", self.samples, len(dataset))

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based) evaluates: every ``interval``-th and the last one."""
        return self.cfg.interval > 0 and (step % self.cfg.interval == 0 or step == self.trainer.train.steps)

    def run(self) -> dict[str, float]:
        """``{"loss", "ppl", "tokens"}`` of the validation batches (a collective on every rank)."""
        t = self.trainer
        g = t.train.global_batch_size
        loss_sum, tokens = torch.zeros((), dtype=torch.float64), 0.0
        with self._eval_mode():
            for k in range(self.cfg.iters):
                micro = self.data(k * g)
                local = float(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro))
                tokens += comm.all_reduce_tensor(torch.tensor(local, dtype=torch.float64), t.groups.dp).item()
                loss_sum += t.forward_loss(micro)
        counted = loss_sum if (t.last and t.groups.tp_rank == 0) else torch.zeros_like(loss_sum)
        total = comm.all_reduce_tensor(counted, torch.distributed.group.WORLD).item()
        loss = total / max(tokens, 1.0)
        return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": tokens}

    @contextlib.contextmanager
    def _eval_mode(self):
        from megamoe.model.moe_controls import recording

        t = self.trainer
        t.phase = "evaluation"
        with contextlib.ExitStack() as stack:
            for chunk in t.chunks:
                stack.enter_context(recording(chunk, False))
                chunk.eval()
            try:
                yield
            finally:
                for chunk in t.chunks:
                    chunk.train()

    def maybe_save_best(self, loss: float) -> Path | None:
        """Write ``<checkpoint.dir>/best`` when ``loss`` is the lowest validation loss so far."""
        t = self.trainer
        if not self.cfg.save_best or not (loss < t.best_eval_loss):
            return None
        t.best_eval_loss = loss
        return t.save(Path(t.recipe.checkpoint.dir) / BEST, keep_last=1)
