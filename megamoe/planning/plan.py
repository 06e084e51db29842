"""Plan a model without allocating it: build on the meta device, report layout and budget."""
from __future__ import annotations

import torch

from megamoe.core.config import ModelConfig
from megamoe.model.fp8_base import scale_names
from megamoe.model.params import ParamBudget, count_parameters, format_budget, human


def meta_model(cfg: ModelConfig):
    """The full model on ``torch.device('meta')``: shapes only, no memory, no init.
    With ``cfg.vision`` it is the multimodal model (its tower counts as part ``vision``)."""
    from megamoe.model.build import build_model

    with torch.device("meta"):
        return build_model(cfg, device="meta")


def budget(cfg: ModelConfig) -> ParamBudget:
    return count_parameters(meta_model(cfg))


def describe(cfg: ModelConfig) -> str:
    """Layout, per-layer kinds and the parameter budget, as printed by tools/show_model.py."""
    from megamoe.core.layout import MIXERS, MLPS

    layout = cfg.validate()
    b = budget(cfg)
    kinds = {f"layers.{i}": str(k) for i, k in enumerate(layout.layers)}
    kinds.update({f"mtp.{k}": str(kind) for k, kind in enumerate(cfg.mtp.kinds() if cfg.mtp is not None else ())})
    counts = layout.counts()
    legend = ", ".join(f"{k}={MIXERS[k][0]} x{counts[k]}" for k in MIXERS if k in counts)
    legend += "; " + ", ".join(f"{k}={MLPS[k][0]} x{counts[k]}" for k in MLPS if k in counts)
    stages = f"{len(layout.cuts) + 1} pipeline stage(s)" if layout.cuts else "no pipeline cuts"
    mtp = f"; multi-token prediction: {cfg.mtp.num_layers} depth(s) {cfg.mtp.layout}" if cfg.mtp is not None else ""
    lines = [
        f"layout: {cfg.layout}",
        f"layers: {layout.num_layers} ({stages}): {layout.compact()}{mtp}",
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
    if bits[0] in ("final_norm", "output_layer", "mtp"):
        return len(stages) - 1
    return 0  # embedding, vision tower


def planned_model(cfg: ModelConfig, lora=None):
    """The meta model a plan reads (with adapters when ``lora`` is set). Its sharding rules name
    groups, not sizes, so one serves every layout."""
    model = meta_model(cfg)
    if lora is not None:
        from megamoe.lora import apply_lora

        apply_lora(model, lora)
    return model


def _grid(parallel, world_size: int) -> dict[str, int]:
    dp = world_size // (parallel.tp * parallel.pp * parallel.cp)
    edp = world_size // (parallel.etp * parallel.ep * parallel.pp)
    return {"tp": parallel.tp, "ep": parallel.ep, "etp": parallel.etp, "dp": dp, "cp": parallel.cp,
            "dp_cp": dp * parallel.cp, "edp": edp}


def _count(row: dict, p, local: float, g: dict, zero1: bool, scales: bool) -> None:
    """One rank's ``local`` elements of ``p`` in its stage's ``row``: weights, gradients and AdamW
    state (``scales``: a frozen FP8 weight's scales, bytes but not parameters)."""
    from megamoe.parallel.record import record
    from megamoe.parallel.sharding import sharding

    row["params"] += 0 if scales else local
    row["stored" if record(p).stored else "weights"] += local * p.element_size()
    if p.requires_grad:
        replicas = g["edp"] if any(r.group in ("ep", "etp") for r in sharding(p)) else g["dp_cp"]
        state = 8 + (4 if p.dtype != torch.float32 else 0)      # moments (+ fp32 master)
        row["grads"] += local * p.element_size()
        row["optim"] += local * state / (replicas if zero1 else 1)


def stage_memory(cfg: ModelConfig, parallel, world_size: int, micro_batch: int, seq_len: int, *,
                 lora=None, offload: bool = False, recompute=(), zero1: bool = True, model=None,
                 micro_batches: int | None = None, activation_bytes: int = 2, mtp: bool = False) -> list[dict]:
    """Bytes one rank of each pipeline stage holds (on the device, and in host memory with
    ``offload``): parameters in their dtype; gradients of trainable parameters in that dtype;
    AdamW's two fp32 moments, plus an fp32 master for a parameter below fp32, split over the
    data(-context)-parallel ranks by ZeRO-1 (experts over the expert-data-parallel ones);
    activations.

    Activations (``megamoe.planning.activations``): the bytes one micro-batch keeps for backward,
    read off one traced forward of each layer kind (under ``recompute``: the recomputed parts'
    inputs instead, plus one layer's recomputation while its backward runs), the last stage's
    logits and loss softmax; times the micro-batches in flight on the stage under 1F1B
    (``pp - stage``, at most ``micro_batches``), plus the backward's working set (one layer's
    kept bytes: the activation gradients it produces while its inputs are still held).
    ``activation_bytes``: 2 for bf16 (a GPU run under autocast, or bf16 parameters), 4 for an
    fp32 run. CP divides the tokens. ``model``: the meta model (``planned_model``) when
    planning many layouts of one. The multi-token-prediction depths sit on the last stage, with a
    copy of the embedding there (as a tied output layer has); ``mtp``: they train
    (``train.mtp_loss_weight`` > 0), so their activations count.

    Tiered experts (``model.moe.expert_store.budget_mib``): their weights stay in the store
    (``stored``: the bytes a rank's store holds, on disk or, with the ``host`` tier, in host
    memory) and a stage holding any counts ``min(budget, stored)`` resident instead.

    Redundant experts (``model.moe.redundant_experts=N``): each MoE layer's N/ep replica slots
    hold weights fetched from their owners for the micro-batch (``megamoe.layers.mlp.replicas``),
    kept for its backward: N/E of the rank's routed-expert bytes per layer, counted with the
    activations of every micro-batch in flight."""
    import math

    from megamoe.planning.activations import stage_activations
    from megamoe.parallel.sharding import sharding

    layout = cfg.validate()
    stages = layout.stages(parallel.pp * parallel.vpp)
    g = _grid(parallel, world_size)
    model = model if model is not None else planned_model(cfg, lora)
    rows = [dict(layers=ids, params=0.0, weights=0.0, grads=0.0, optim=0.0, activations=0.0, stored=0.0,
                 replicas=0.0) for ids in stages]
    replicated = cfg.moe.redundant_experts / cfg.moe.num_experts if cfg.moe is not None else 0.0
    fp8_scales = scale_names(model)
    for name, p in model.named_parameters():
        rules = sharding(p)
        local = math.prod(p.shape) / math.prod(g.get(r.group, 1) for r in rules)
        copied = name == "embedding.weight" and (cfg.tie_embeddings or cfg.mtp is not None)
        for i in {_stage_of(name, stages), *([len(stages) - 1] if copied else [])}:  # the last stage's copy
            _count(rows[i], p, local, g, zero1, scales=name in fp8_scales)
        if replicated and name.endswith(("experts.gate_up_weight", "experts.down_weight")):
            rows[_stage_of(name, stages)]["replicas"] += local * replicated * p.element_size()
    acts = stage_activations(cfg, stages, micro_batch, seq_len // parallel.cp, tp=parallel.tp,
                             sp=parallel.sequence_parallel, etp=parallel.etp, act=activation_bytes, recompute=recompute,
                             mtp=mtp, cp=parallel.cp)
    store = cfg.moe.expert_store if cfg.moe is not None else None
    for i, (row, a) in enumerate(zip(rows, acts)):
        if row["stored"]:
            row["weights"] += min(store.budget_mib * 2 ** 20, row["stored"])
        in_flight = parallel.pp - i % parallel.pp if parallel.pp > 1 else 1
        if micro_batches is not None:
            in_flight = min(in_flight, micro_batches)
        row["activations"] = in_flight * (a["kept"] + row["replicas"]) + a["transient"] + a["working"]
        row["device"] = row["weights"] + row["grads"] + row["activations"] + (0 if offload else row["optim"])
        row["host"] = (row["optim"] if offload else 0.0) + (row["stored"] if store and store.tier == "host" else 0.0)
    return rows


def recipe_options(recipe, parallel=None, world_size: int | None = None) -> dict:
    """``stage_memory``'s keyword arguments for a training recipe run on GPUs: LoRA, offload,
    recompute, ZeRO-1, activations in bf16 (autocast, or bf16 parameters; 4 bytes only for
    ``train.precision=fp32`` with fp32 parameters) and, given a layout, the micro-batches per
    step (they bound the 1F1B stages' micro-batches in flight)."""
    t = recipe.train
    bf16 = recipe.model.params_dtype != "float32" or t.precision != "fp32"
    opts = dict(lora=recipe.lora, offload=t.optimizer_offload, recompute=t.recompute, zero1=recipe.optim.zero1,
                activation_bytes=2 if bf16 else 4, mtp=t.mtp_loss_weight > 0)
    if parallel is not None:
        per_rank = t.micro_batch_size * (world_size // (parallel.tp * parallel.pp * parallel.cp))
        if per_rank and t.global_batch_size % per_rank == 0:
            opts["micro_batches"] = t.global_batch_size // per_rank
    return opts


def memory_plan(cfg: ModelConfig, parallel, world_size: int, micro_batch: int, seq_len: int, **kw) -> str:
    """Per pipeline stage, what one rank holds (``stage_memory``), as printed by megamoe-plan."""
    parallel.validate(world_size)
    g = _grid(parallel, world_size)
    out = [f"grid: world {world_size} = tp {parallel.tp} x pp {parallel.pp} x cp {parallel.cp} x dp {g['dp']}; "
           f"experts: etp {parallel.etp} x ep {parallel.ep} x edp {g['edp']}; vpp {parallel.vpp}, "
           f"sequence_parallel {parallel.sequence_parallel}",
           f"{'stage':<7}{'layers':<10}{'params/rank':>12}{'weights':>10}{'grads':>9}{'optimizer':>11}"
           f"{'activ.':>9}{'device':>9}{'host':>8}{'stored':>8}   (GiB)"]
    for i, r in enumerate(stage_memory(cfg, parallel, world_size, micro_batch, seq_len, **kw)):
        ids = r["layers"]
        span = f"{ids[0]}-{ids[-1]}" if ids else "-"
        out.append(f"{i:<7}{span:<10}{human(r['params']):>12}" + "".join(
            f"{r[k] / 2 ** 30:>{w}.2f}" for k, w in (("weights", 10), ("grads", 9), ("optim", 11),
                                                       ("activations", 9), ("device", 9), ("host", 8),
                                                       ("stored", 8))))
    return "\n".join(out)


LONG_CONTEXT = (128 * 1024, 256 * 1024, 512 * 1024, 1024 * 1024)


def long_context_plan(cfg: ModelConfig, parallel, world_size: int, lengths=LONG_CONTEXT, **kw) -> str:
    """The busiest rank's device memory (GiB, ``stage_memory``; one sequence per micro-batch) for
    each length in ``lengths`` at every CP size the world allows with the recipe's tp, pp, ep and
    etp, so the CP a context length needs can be read off; as printed by megamoe-plan --long-context."""
    import dataclasses

    from megamoe.core.errors import ConfigError

    model = planned_model(cfg, kw.pop("lora", None))
    cps = []
    for cp in (1, 2, 4, 8, 16, 32, 64, 128):
        trial = dataclasses.replace(parallel, cp=cp)
        try:
            trial.validate(world_size)
        except ConfigError:
            continue
        cps.append(trial)
    if not cps:
        raise ConfigError(f"--long-context: no CP size fits --world-size {world_size} with parallel.tp*pp="
                          f"{parallel.tp * parallel.pp}")
    head = f"{'tokens':<8}" + "".join(f"{'cp=' + str(p.cp):>9}" for p in cps)
    out = [f"long context: busiest rank's device memory (GiB), micro-batch 1, tp {parallel.tp} pp {parallel.pp} "
           f"ep {parallel.ep} etp {parallel.etp}, sequence_parallel {parallel.sequence_parallel}", head]
    for n in lengths:
        cells = [max(r["device"] for r in stage_memory(cfg, p, world_size, 1, n, model=model, **kw)) / 2 ** 30
                 for p in cps]
        name = f"{n // 2 ** 20}M" if n % 2 ** 20 == 0 else f"{n // 1024}K"
        out.append(f"{name:<8}" + "".join(f"{c:>9.2f}" for c in cells))
    return "\n".join(out)


def fitting_layouts(recipe, world_size: int, device_bytes: float, most: int = 10) -> list[tuple[dict, float]]:
    """(parallel degrees, busiest rank's device bytes) of the layouts of ``world_size`` ranks the
    trainer accepts for ``recipe`` whose every rank fits ``device_bytes``, smallest first.
    Tried: tp in 1..8 (with sequence parallelism), pp dividing the world (the layout's cut
    count when it has cuts), ep a power of two dividing the experts; etp 1, cp 1, vpp 1."""
    import dataclasses

    from megamoe.core.errors import ConfigError

    moe = recipe.model.moe
    experts = moe.num_experts if moe is not None else 1
    model, found = planned_model(recipe.model, recipe.lora), []
    for tp in (1, 2, 4, 8):
        for pp in (p for p in range(1, 65) if world_size % (tp * p) == 0):
            for ep in (e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if experts % e == 0):
                par = dataclasses.replace(recipe.parallel, tp=tp, pp=pp, ep=ep, etp=1, cp=1, vpp=1,
                                          sequence_parallel=tp > 1)
                trial = dataclasses.replace(recipe, parallel=par)
                try:
                    trial.validate_plan(world_size)
                except ConfigError:
                    continue
                rows = stage_memory(recipe.model, par, world_size, recipe.train.micro_batch_size,
                                    recipe.data.seq_len, model=model, **recipe_options(recipe, par, world_size))
                worst = max(r["device"] for r in rows)
                if worst <= device_bytes:
                    found.append(({"tp": tp, "pp": pp, "ep": ep}, worst))
    return sorted(found, key=lambda x: (x[1], x[0]["tp"] * x[0]["pp"]))[:most]
