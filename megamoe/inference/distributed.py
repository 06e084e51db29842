"""Generation and verification at a training layout (TP, EP, ETP, PP, CP) under ``torchrun``.

Every rank builds only its pipeline stage with its own shards (``megamoe.inference.load.load_model`` with ``groups``: an HF folder is
read tensor by tensor, each sliced to this rank's piece; a megamoe checkpoint loads its own
piece through torch.distributed.checkpoint) and runs the same decoding loop
(``megamoe.inference.generate.stream``) over the same prompts. ``StageForward`` is the forward that loop
calls:

    stage 0:       ids [b, s] -> embed, its layers -> send hidden [b, s, (n,) h] to stage 1
    stage r:       recv hidden from r - 1 -> its layers -> send to r + 1
    last stage:    recv -> its layers, norm, output -> logits gathered over TP [b, s, V]
    every rank:    the last stage's logits broadcast over the pipeline group

so every rank picks the same token from the same logits (sampling draws from one seed on
every rank). Each stage keeps its own decode cache. TP ranks gather logits as in training;
EP/ETP ranks all-to-all their tokens inside MoE layers as in training.

Context parallelism (``--cp``) splits the prefill and the cache: each CP rank runs its two
chunks of the prompt as in training (ring attention, state passing, all-gathered latents). With
the split caches (``cache_factory``; ``megamoe.layers.cache.split``) the softmax (A, S),
block-sparse (B), MLA (M) and DSA (D, R, I: latents) layers keep only this rank's chunks of the
keys (indexer keys whole), and each later token is kept by rank ``position % CP``; a decode step
runs the same on every CP rank, each attends over its own keys and one all-gather a layer merges
the ranks' parts by their log-sum-exps. Linear mixers' states and the V4 caches hold the whole
prompt on every rank (all-gathered, or passed on to the end), as the plain caches keep every
mixer's. The prompt's last token is the last local token of CP rank 0, whose logits are
broadcast over the CP group; stages send their local chunks' hidden states. Prompts must have
equal length.

Sequence parallelism is not used for decoding: a step feeds one token per row, which cannot be
split over TP ranks. Its weights are those of TP alone, so a TP+SP checkpoint decodes at the
same tp without SP.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megamoe.core.config import ParallelConfig
from megamoe.core.errors import ConfigError
from megamoe.layers.cache.decode import InferenceCache
from megamoe.layers.cache.paged import PagedCache
from megamoe.layers.cache.split import ContextSplitCache, PagedContextSplitCache
from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups, build_groups, init_distributed


def inference_groups(parallel: ParallelConfig) -> ParallelGroups:
    """The process groups of ``parallel`` (torch.distributed initialised from torchrun's env)."""
    if parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel: decoding feeds one token per step, which cannot be split "
                          "over TP ranks; decode at the same tp without it (the weights are the same)")
    if parallel.vpp > 1:
        raise ConfigError(f"parallel.vpp={parallel.vpp}: decoding supports tp, pp, ep, etp and cp")
    init_distributed()
    return build_groups(parallel)


class StageForward:
    """``forward(ids, cache, last_only=True, **kw)`` -> logits [b, 1 or s, V] on every rank of a
    pipeline; ``ids`` [b, s] is given on every rank (later stages read only its shape)."""

    def __init__(self, model, groups: ParallelGroups):
        self.model, self.groups = model, groups
        self.pp = groups.pp
        self.stages = dist.get_process_group_ranks(self.pp) if groups.size("pp") > 1 else [dist.get_rank()]
        self.stage = groups.rank("pp")
        h = model.config.hidden_size
        self.stream_shape = tuple(model.block.enter_stream(torch.zeros(1, 1, h), model.config).shape[2:])
        self.dtype = model.ctx.dtype

    def __call__(self, ids: torch.Tensor, cache=None, last_only: bool = True, **kw) -> torch.Tensor:
        m, last = self.model, len(self.stages) - 1
        b, s = ids.shape[:2]
        shard = m.sequence_shard(s, cache)  # CP: this forward runs on the local chunks (a prefill)
        x = ids
        if self.stage > 0:
            local = s if shard is None else shard.local_len
            x = torch.empty(b, local, *self.stream_shape, dtype=self.dtype, device=ids.device)
            dist.recv(x, self.stages[self.stage - 1], group=self.pp)
        if self.stage > 0:  # hash-routed MoE layers route by token on every stage
            kw = {**kw, "token_ids": ids}
        out = m.forward_stage(x, cache=cache, **kw)
        if self.stage < last:
            dist.send(out.contiguous(), self.stages[self.stage + 1], group=self.pp)
            logits = torch.empty(b, 1 if last_only else s, m.config.vocab_size, dtype=self.dtype, device=ids.device)
        else:
            logits = m.gather_logits(out[:, -1:] if last_only else out)  # gather only what is kept
            if shard is not None:
                logits = self.cp_logits(logits, shard, last_only)
            logits = (logits[:, -1:] if last_only else logits).contiguous()
        return comm.broadcast_tensor(logits, last, self.pp)

    def cp_logits(self, local: torch.Tensor, shard, last_only: bool) -> torch.Tensor:
        """[b, s_local, V] of this CP rank's chunks -> the full sequence's [b, S, V] (all-gathered),
        or for ``last_only`` CP rank 0's (its back chunk ends the sequence) on every CP rank."""
        if not last_only:
            return shard.gather(local, 1)
        return comm.broadcast_tensor(local[:, -1:].contiguous(), 0, self.model.groups.cp)


def cache_factory(kind: str = "contiguous", block_size: int = 16, forward: "StageForward | None" = None):
    """The decode cache ``stream`` makes for a batch (``megamoe-generate --kv-cache``): "contiguous",
    "paged", "int8" or "fp8" (paged blocks). Under CP (``forward`` a ``StageForward`` of a layout
    with cp > 1) the softmax/MLA/DSA/B keys are split over the CP ranks (``megamoe.layers.cache.split``)."""
    group = forward.groups.cp if forward is not None and forward.groups.size("cp") > 1 else None
    if kind == "contiguous":
        return InferenceCache if group is None else functools.partial(ContextSplitCache, group=group)
    paged = dict(block_size=block_size, kv_dtype="fp32" if kind == "paged" else kind)
    if group is None:
        return functools.partial(PagedCache, **paged)
    return functools.partial(PagedContextSplitCache, group=group, **paged)
