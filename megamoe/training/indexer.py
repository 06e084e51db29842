"""Training the sparse-attention indexer of the D/I layers (``train.indexer``), as DeepSeek-V3.2
does: a dense warm-up, then sparse training (``megamoe.layers.ops.indexer_loss`` has the objective).

    setup_indexer_training(chunks, cfg, global_queries)  # before the optimizer is built
    report = indexer_report(chunks, groups)               # per layer KL, on logging steps (a collective)

Warm-up freezes every parameter but the indexers' (the optimizer then holds only those) and
the trainer skips the expert-bias update, so the model the indexers learn from stays as loaded.
"""
from __future__ import annotations

import torch
from torch import nn

from megamoe.layers.mixers.dsa import Indexer
from megamoe.layers.ops.indexer_loss import IndexerObjective
from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups
from megamoe.training.config import IndexerTrainConfig
from megamoe.training.reports import gather_to_first


def objectives(chunks: list[nn.Module]) -> list[IndexerObjective]:
    return [m for c in chunks for m in c.modules() if isinstance(m, IndexerObjective)]


def setup_indexer_training(chunks: list[nn.Module], cfg: IndexerTrainConfig, global_queries: int) -> None:
    """Set every D/I layer's objective: ``cfg.mode``, and a gradient scale that makes the loss the
    mean KL over the ``global_queries`` query tokens of a global batch times ``loss_coeff``."""
    for o in objectives(chunks):
        o.mode, o.scale = cfg.mode or "off", cfg.loss_coeff / global_queries
    if cfg.mode != "warmup":
        return
    keep = {id(p) for c in chunks for m in c.modules() if isinstance(m, Indexer) for p in m.parameters()}
    for c in chunks:
        for p in c.parameters():
            p.requires_grad_(id(p) in keep)


def indexer_report(chunks: list[nn.Module], groups: ParallelGroups, world: int, rank: int) -> dict[str, float]:
    """``indexer/kl/layerN``: the mean KL per query of each D/I layer over the forwards since the
    last report, and ``indexer_kl`` (their mean), on rank 0. A collective on every rank: sums
    over the data(-context)-parallel ranks (TP ranks hold the same values), gathered over stages."""
    mine = {}
    for o in objectives(chunks):
        if not o.stats:
            continue
        summed = torch.stack([o.stats["kl_sum"], o.stats["queries"]])
        summed = comm.all_reduce_tensor(summed, groups.dp_cp)
        mine[o.layer_number] = (summed[0] / summed[1].clamp_min(1.0)).item()
        o.stats = {}
    merged = {n: v for part in gather_to_first(mine, world, rank) for n, v in part.items()}
    out = {f"indexer/kl/layer{n}": v for n, v in sorted(merged.items())}
    if merged:
        out["indexer_kl"] = sum(merged.values()) / len(merged)
    return out
