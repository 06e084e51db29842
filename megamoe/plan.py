"""Plan a model without allocating it: build on the meta device, report layout and budget."""
from __future__ import annotations

import torch

from megamoe.config import ModelConfig
from megamoe.params import ParamBudget, count_parameters, format_budget, human


def meta_model(cfg: ModelConfig):
    """The full model on ``torch.device('meta')``: shapes only, no memory, no init.
    With ``cfg.vision`` it is the multimodal model (its tower counts as part ``vision``)."""
    from megamoe.model import build_model

    with torch.device("meta"):
        return build_model(cfg, device="meta")


def budget(cfg: ModelConfig) -> ParamBudget:
    return count_parameters(meta_model(cfg))


def describe(cfg: ModelConfig) -> str:
    """Layout, per-layer kinds and the parameter budget, as printed by tools/show_model.py."""
    from megamoe.layout import MIXERS, MLPS

    layout = cfg.validate()
    b = budget(cfg)
    kinds = {f"layers.{i}": str(k) for i, k in enumerate(layout.layers)}
    counts = layout.counts()
    legend = ", ".join(f"{k}={MIXERS[k][0]} x{counts[k]}" for k in MIXERS if k in counts)
    legend += "; " + ", ".join(f"{k}={MLPS[k][0]} x{counts[k]}" for k in MLPS if k in counts)
    stages = f"{len(layout.cuts) + 1} pipeline stage(s)" if layout.cuts else "no pipeline cuts"
    lines = [
        f"layout: {cfg.layout}",
        f"layers: {layout.num_layers} ({stages}): {layout.compact()}",
        f"kinds: {legend}",
        format_budget(b, kinds),
        f"summary: {human(b.total)} total, {human(b.active)} active per token, "
        f"{layout.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
    ]
    return "\n".join(lines)


def _stage_of(name: str, stages: list[list[int]]) -> int:
    bits = name.split(".")
    if bits[0] == "layers":
        layer = int(bits[1])
        return next(i for i, ids in enumerate(stages) if layer in ids)
    if bits[0] in ("final_norm", "output_layer"):
        return len(stages) - 1
    return 0  # embedding, vision tower


def memory_plan(cfg: ModelConfig, parallel, world_size: int, micro_batch: int, seq_len: int) -> str:
    """Per pipeline stage: parameters held by one rank and a memory estimate (fp32 params and
    grads, Adam moments split by ZeRO-1 over data-parallel ranks, rough activations)."""
    import math

    from megamoe.parallel.sharding import sharding

    parallel.validate(world_size)
    layout = cfg.validate()
    n_stages = parallel.pp * parallel.vpp
    stages = layout.stages(n_stages)
    sizes = {"tp": parallel.tp, "ep": parallel.ep, "etp": parallel.etp}
    dp = world_size // (parallel.tp * parallel.pp * parallel.cp)
    edp = world_size // (parallel.etp * parallel.ep * parallel.pp)
    per_stage = [[0, 0.0] for _ in range(n_stages)]  # params, bytes
    for name, p in meta_model(cfg).named_parameters():
        rules = sharding(p)
        local = math.prod(p.shape) / math.prod(sizes.get(r.group, 1) for r in rules)
        expert = any(r.group in ("ep", "etp") for r in rules)
        stage = _stage_of(name, stages)
        per_stage[stage][0] += local
        per_stage[stage][1] += local * (4 + 4 + 8 / (edp if expert else dp))
    rows = [f"grid: world {world_size} = tp {parallel.tp} x pp {parallel.pp} x cp {parallel.cp} x dp {dp}; "
            f"experts: etp {parallel.etp} x ep {parallel.ep} x edp {edp}; vpp {parallel.vpp}, "
            f"sequence_parallel {parallel.sequence_parallel}",
            f"{'stage':<7}{'layers':<18}{'params/rank':>14}{'weights+grads+adam':>20}{'activations~':>14}"]
    sp = parallel.tp if parallel.sequence_parallel else 1
    for i, ids in enumerate(stages):
        # ~34 bytes per hidden element per layer kept for backward (Megatron's estimate, fp16/bf16)
        act = len(ids) * 34 * micro_batch * seq_len * cfg.hidden_size / sp
        span = f"{ids[0]}-{ids[-1]}" if ids else "-"
        rows.append(f"{i:<7}{span:<18}{human(per_stage[i][0]):>14}{per_stage[i][1] / 2**30:>18.2f}G"
                    f"{act / 2**30:>13.2f}G")
    return "\n".join(rows)
