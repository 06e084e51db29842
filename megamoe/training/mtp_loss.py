"""The trainer's part of the multi-token-prediction loss (``train.mtp_loss_weight``; ``megamoe.model.mtp``).

Per step: each depth's target count over the global batch (an all-reduce over the data-parallel
ranks; CP ranks hold the same labels), from which each depth's loss factor lambda / (D * count_k)
follows; the last pipeline stage gets every micro-batch's ids and labels with those factors and
attaches the loss to its output's gradient, so any layout sums to the single-process gradient.
Reported: ``mtp_loss``, the mean over depths of each depth's cross-entropy (without lambda).

With ``train.mtp_loss_weight`` 0 the MTP depths do not run in training and their parameters
(adapters included) are frozen: no gradient, no weight decay.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megamoe.core.errors import ConfigError
from megamoe.model.mtp import MTPTargets, depth_scales, target_counts
from megamoe.parallel import comm

log = logging.getLogger(__name__)


class MTPLoss:
    """``chunks``: this rank's model chunks; ``last``: whether it holds the last stage."""

    def __init__(self, recipe, chunks, groups, last: bool):
        mtp = recipe.model.mtp
        self.depths = mtp.num_layers if mtp is not None else 0
        self.weight = recipe.train.mtp_loss_weight
        if self.weight > 0 and mtp is None:  # checked here: a fine-tune's model is its checkpoint's
            raise ConfigError(f"train.mtp_loss_weight={self.weight} needs model.mtp (the model has no "
                              f"multi-token-prediction layers)")
        self.active = self.depths > 0 and self.weight > 0
        self.groups, self.last, self.chunks = groups, last, chunks
        self.counts, self.scales = [0.0] * self.depths, [0.0] * self.depths
        if self.depths and not self.active:
            self.freeze()

    def freeze(self) -> None:
        """Nothing of the MTP depths trains (call before the optimizer is built)."""
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                if name.startswith("mtp."):
                    p.requires_grad_(False)
        if dist.get_rank() == 0:
            log.info("model.mtp: %d depth(s) frozen (train.mtp_loss_weight=0)", self.depths)

    def start_step(self, micro: list[dict]) -> None:
        """Each depth's target count over the global batch and its loss factor (a collective over dp)."""
        if not self.active:
            return
        local = torch.zeros(self.depths, dtype=torch.float64)
        for mb in micro:
            local += torch.tensor(target_counts(mb["labels"], self.depths, mb.get("documents")), dtype=torch.float64)
        self.counts = comm.all_reduce_tensor(local, self.groups.dp).tolist()
        self.scales = depth_scales(self.weight, self.counts)
        for chunk in self.chunks:
            chunk.mtp_loss_sums = torch.zeros_like(chunk.mtp_loss_sums)

    def targets(self, mb: dict, device) -> dict:
        """The last stage's keyword input for one micro-batch (none when MTP does not train)."""
        if not self.active:
            return {}
        return {"mtp": MTPTargets(mb["input_ids"].to(device), mb["labels"].to(device), self.scales)}

    def report(self) -> dict[str, float]:
        """``mtp_loss``: the mean over depths of each depth's cross-entropy (a collective over all ranks)."""
        if not self.active:
            return {}
        sums = torch.zeros(self.depths, dtype=torch.float64)
        if self.last and self.groups.tp_rank == 0:  # every data-parallel and CP rank's own tokens, once
            sums += sum(chunk.mtp_loss_sums for chunk in self.chunks if chunk.mtp is not None)
        sums = comm.all_reduce_tensor(sums, dist.group.WORLD).tolist()
        per_depth = [s / c for s, c in zip(sums, self.counts) if c > 0]
        return {"mtp_loss": sum(per_depth) / len(per_depth)} if per_depth else {}
