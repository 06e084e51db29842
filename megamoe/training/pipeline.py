"""Pipeline parallelism with ``torch.distributed.pipelining`` (device-agnostic, runs on gloo).

Stage cuts come from the layout string: ``layout.stages(pp * vpp)`` gives the layers of each
virtual stage; pipeline rank r holds virtual stages r, r + pp, r + 2*pp, ... (interleaved
1F1B when vpp > 1). Activations between stages are the residual stream ``[b, s(/tp), h]``
(``[b, s(/tp), n, h]`` with hyper-connections; s = S/cp, this rank's CP chunks); the last
stage returns vocab-parallel logits of the local tokens and the schedule applies the loss
there (the full labels, cut by the model's ``loss_sum``).
"""
from __future__ import annotations

import contextlib
import functools
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from megamoe.core.config import ModelConfig, ParallelConfig, check_pipeline_support
from megamoe.model.language_model import LanguageModel
from megamoe.model.build import build_model
from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups


def stage_ids(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """Virtual stage indices held by pipeline rank ``pp_rank``."""
    return [pp_rank + i * parallel.pp for i in range(parallel.vpp)]


def build_chunks(cfg: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups, device=None,
                 fp8: str | None = None) -> tuple[list[LanguageModel], list[int]]:
    """This rank's model chunks (one per virtual stage) and their stage indices; ``fp8``: the
    backend's FP8 recipe (train.fp8)."""
    check_pipeline_support(cfg, parallel)
    n_stages = parallel.pp * parallel.vpp
    stages = cfg.parsed_layout().stages(n_stages)
    ids = stage_ids(parallel, groups.rank("pp"))
    chunks = [build_model(cfg, groups, sequence_parallel=parallel.sequence_parallel, layer_ids=stages[i],
                          pre_process=i == 0, post_process=i == n_stages - 1, device=device, fp8=fp8)
              for i in ids]
    return chunks, ids


class StageModule(nn.Module):
    """The callable a PipelineStage runs: ids or hidden states in, hidden states or logits out.

    ``extra`` holds the stage's keyword inputs per micro-batch (a multimodal model's preprocessed
    images on the first stage, a list per sample, which the schedule cannot split as tensors;
    packed samples' ``documents`` and ``positions`` on every stage): each
    forward takes the next, in micro-batch order (the order every schedule runs a stage's
    forwards in), so the tower runs inside the stage and its backward with the stage's."""

    def __init__(self, chunk: LanguageModel):
        super().__init__()
        self.chunk = chunk
        self.extra: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk.forward_stage(x, **(self.extra.pop(0) if self.extra else {}))


def stage_examples(chunk: LanguageModel, micro_batch: int, seq_len: int, device, logits_dtype: torch.dtype):
    """Example input and output of a stage, so the schedule runs in static mode. (Dynamic
    mode would run an extra forward and backward to infer shapes, which MoE routers would
    count as real tokens.)"""
    ctx = chunk.ctx
    cp_seq = seq_len // chunk.cp_size  # this rank's CP chunks
    local_seq = cp_seq // ctx.groups.tp_size if ctx.sp else cp_seq
    # requires_grad marks activations whose gradients travel between stages; the residual stream
    # between stages may carry more than [b, s, h] (hyper-connections: [b, s, n, h])
    hidden = torch.zeros(micro_batch, local_seq, ctx.hidden_size, dtype=ctx.dtype, device=device)
    hidden = chunk.block.enter_stream(hidden, chunk.config).contiguous().requires_grad_(True)
    inp = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device) if chunk.pre_process else hidden
    if chunk.post_process:
        vocab = -(-chunk.config.vocab_size // ctx.groups.tp_size)
        out = torch.zeros(micro_batch, cp_seq, vocab, dtype=logits_dtype, device=device, requires_grad=True)
    else:
        out = hidden
    return inp, out


@functools.cache
def _stage_class():
    """``PipelineStage`` running each backward inside ``backward_scope(last_backward)``: the
    schedule knows which backward of a step is a stage's last (the one whose gradients are final)."""
    from torch.distributed.pipelining import PipelineStage

    class ScopedStage(PipelineStage):
        backward_scope = None

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            scope = self.backward_scope(last_backward) if self.backward_scope else contextlib.nullcontext()
            with scope:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    return ScopedStage


def build_schedule(chunks: list[LanguageModel], ids: list[int], n_stages: int, groups: ParallelGroups,
                   n_microbatches: int, loss_fn: Callable, device: torch.device, micro_batch: int, seq_len: int,
                   logits_dtype: torch.dtype = torch.float32, backward_scope: Callable | None = None):
    """A 1F1B (one chunk per rank) or interleaved 1F1B schedule over the pp group, and the
    ``StageModule`` of each chunk. ``backward_scope(last)``: a context around each backward of a
    stage, ``last`` for its last micro-batch (the overlapped gradient sums).

    Gradients are not rescaled by the schedule: ``loss_fn`` already divides by the global
    token count.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    stages, modules = [], [StageModule(c) for c in chunks]
    for m, c, i in zip(modules, chunks, ids):
        inp, out = stage_examples(c, micro_batch, seq_len, device, logits_dtype)
        stage = _stage_class()(m, stage_index=i, num_stages=n_stages, device=device,
                               input_args=(inp,), output_args=(out,), group=groups.pp)
        stage.backward_scope = backward_scope
        stages.append(stage)
    if len(stages) == 1:
        return Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False), modules
    return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False), modules


@contextmanager
def timed_p2p():
    """On a sampled step (a ``comm`` recorder active), time the pipeline schedule's sends and
    receives as ``send_recv`` on the ``pp`` group (tag ``pipeline``); otherwise nothing at all.

    ``torch.distributed.pipelining`` issues them through its module functions ``_batch_p2p``
    and ``_wait_batch_p2p``; they are wrapped for the step only. A batch's sample is the time
    the schedule spends issuing it and waiting for all its works (``comm.P2PTimer``). Without
    those functions (another torch) the pipeline is not timed.
    """
    from torch.distributed.pipelining import schedules

    batch_fn, wait_fn = getattr(schedules, "_batch_p2p", None), getattr(schedules, "_wait_batch_p2p", None)
    if comm.active_recorder() is None or batch_fn is None or wait_fn is None:
        yield
        return
    open_: dict[int, list] = {}  # id(work) -> [its batch's timer, works of the batch not yet waited]

    def batch_p2p(ops, desc=None):
        if not ops:  # the schedules pass empty batches (a stage with no peer that way)
            return batch_fn(ops, desc=desc)
        timer = comm.p2p_timer(ops[0].group, [op.tensor for op in ops], "pipeline")
        works = batch_fn(ops, desc=desc)
        timer.pause()
        entry = [timer, len(works)]
        for w in works:
            open_[id(w)] = entry
        if not works:
            timer.finish()
        return works

    def wait_batch_p2p(works):
        for w in works:
            entry = open_.pop(id(w), None)
            if entry is not None:
                entry[0].resume()
            w.wait()
            if entry is not None:
                entry[0].pause()
                entry[1] -= 1
                if entry[1] == 0:
                    entry[0].resume()
                    entry[0].finish()

    schedules._batch_p2p, schedules._wait_batch_p2p = batch_p2p, wait_batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = batch_fn, wait_fn
