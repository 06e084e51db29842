"""What a training step reports beyond its loss: validation when due, and on logging steps the
MoE metrics and expert load, the indexer KL and the communication samples of every rank,
gathered to rank 0 for the monitor. Each gather is a collective: every rank calls these on the
same steps (``Monitor.logs`` gives the same answer everywhere)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def gather_to_first(mine: dict, world: int, rank: int) -> list[dict]:
    """Every rank's dict, on rank 0 (an empty list elsewhere)."""
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered or []


def moe_report(trainer) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Per-layer expert load (for the figure) and scalars over the steps since the last report."""
    if not trainer.has_moe:
        return {}, {}
    from megamoe.model.moe_controls import moe_metrics

    mine = {}
    for chunk in trainer.chunks:
        mine.update(moe_metrics(chunk, trainer.groups))
    merged = {n: m for part in gather_to_first(mine, trainer.world, trainer.rank) for n, m in part.items()}
    load = {n: torch.tensor(m["tokens_per_expert"]) for n, m in merged.items()}
    scalars = {f"moe/{key}/layer{n}": float(m[key]) for n, m in merged.items()
               for key in ("imbalance", "router_entropy", "dropped_tokens", "aux_loss", "seq_aux_loss", "z_loss")
               if key in m}
    return load, scalars


def gather_latencies(trainer) -> dict[str, list[tuple[float, int]]]:
    """The (seconds, bytes) samples of every rank since the last call, by ``comm.sample_key``."""
    if trainer.recorder is None:
        return {}
    mine = {f"rank{trainer.rank}/{k}": v for k, v in trainer.recorder.drain().items()}
    out: dict[str, list[tuple[float, int]]] = {}
    for part in gather_to_first(mine, trainer.world, trainer.rank):
        for k, v in part.items():
            out.setdefault(k.split("/", 1)[1], []).extend(v)
    return out


def report_step(trainer, monitor, metrics: dict, evaluator) -> None:
    """Evaluate when due, then log the step; keep the best checkpoint (``eval.save_best``)."""
    tagged = {}
    if evaluator is not None and evaluator.due(trainer.step):
        result = evaluator.run()
        metrics.update(eval_loss=result["loss"], eval_ppl=result["ppl"])
        tagged = {"eval/loss": result["loss"], "eval/ppl": result["ppl"]}
    load, scalars, latencies = {}, {}, {}
    trainer.phase = "metrics report"
    if monitor.logs(trainer.step):
        load, scalars = trainer.moe_report()
        latencies = gather_latencies(trainer)
        if trainer.train.indexer.mode is not None:
            from megamoe.training.indexer import indexer_report

            report = indexer_report(trainer.chunks, trainer.groups, trainer.world, trainer.rank)
            metrics.update({k: v for k, v in report.items() if "/" not in k})
            scalars.update({k: v for k, v in report.items() if "/" in k})
    monitor.log_step(trainer.step, metrics, latencies, load, scalars, tagged=tagged)
    if tagged:
        evaluator.maybe_save_best(tagged["eval/loss"])
