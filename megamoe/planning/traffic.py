"""Communication volume of a training step, from the layout alone (no processes).

Bytes are counted the way the communication monitor records them
(``megamoe.parallel.comm.LatencyRecorder``): the input buffer of an all-to-all, so a rank's
own rows count too. A step is ``global_batch_size`` sequences of ``seq_len`` tokens.
"""
from __future__ import annotations

from megamoe.core.layout import MOE_LETTERS


def routed_tokens(recipe, parallel, world_size: int) -> float:
    """Tokens one rank routes per step: its data-parallel share, cut over CP and TP (the MoE
    layer splits the sequence over TP, with or without sequence parallelism)."""
    dp = world_size // (parallel.tp * parallel.pp * parallel.cp)
    return recipe.train.global_batch_size * recipe.data.seq_len / dp / (parallel.cp * parallel.tp)


def moe_layers(cfg) -> int:
    return sum(1 for k in cfg.parsed_layout().layers if k.mlp in MOE_LETTERS)


def ep_bytes(recipe, parallel, world_size: int, act_bytes: int = 4) -> float:
    """Bytes one rank puts into the token all-to-alls over ep in a step (the mean over ranks,
    dropless; each rank's share of the pipeline's MoE layers). Per MoE layer and routed
    (token, expert) pair: its row (``act_bytes`` per hidden element) out and back, forward and
    backward (4 rows), its fp32 routing weight out and its gradient back (8 bytes); plus the
    per-expert counts (int64) exchanged once."""
    moe = recipe.model.moe
    if moe is None or parallel.ep == 1:
        return 0.0
    pairs = routed_tokens(recipe, parallel, world_size) * moe.top_k
    per_layer = pairs * (4 * recipe.model.hidden_size * act_bytes + 8) + 8 * moe.num_experts * micro_batches(
        recipe, parallel, world_size)
    return per_layer * moe_layers(recipe.model) / parallel.pp


def micro_batches(recipe, parallel, world_size: int) -> int:
    dp = world_size // (parallel.tp * parallel.pp * parallel.cp)
    return recipe.train.global_batch_size // (recipe.train.micro_batch_size * dp)


def describe_ep_span(recipe, parallel, world_size: int, node: int, act_bytes: int = 2) -> str | None:
    """One line for an EP group spread over nodes (None when each EP group stays in one): the
    nodes it spans and the bytes per step and rank its all-to-alls put on the network."""
    from megamoe.parallel.topology import nodes_spanned, remote_share

    spans = nodes_spanned(parallel.etp * parallel.ep, node)
    if spans == 1 or recipe.model.moe is None:
        return None
    remote = ep_bytes(recipe, parallel, world_size, act_bytes) * remote_share(parallel, node)
    return (f"parallel.ep={parallel.ep} x etp={parallel.etp} spans {spans} nodes of {node} GPUs: the token "
            f"all-to-alls send about {remote / 2 ** 30:.3g} GiB per step and rank across nodes "
            f"({remote_share(parallel, node):.0%} of their {ep_bytes(recipe, parallel, world_size, act_bytes) / 2 ** 30:.3g} GiB)")


# ---- every group of a step ---------------------------------------------------------------------

def stage_param_bytes(model, parallel, world_size: int, stages: list[list[int]]) -> list[dict[str, float]]:
    """Per pipeline stage, one rank's bytes of trainable parameters: dense, expert, and the
    TP-replicated ones whose gradient is a partial sum over TP (routers; under SP norms and gates too)."""
    import math

    from megamoe.parallel.sharding import sharding
    from megamoe.planning.plan import _grid, _stage_of

    g = _grid(parallel, world_size)
    rows = [{"dense": 0.0, "expert": 0.0, "tp_partial": 0.0} for _ in stages]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        rules = sharding(p)
        nbytes = math.prod(p.shape) / math.prod(g.get(r.group, 1) for r in rules) * p.element_size()
        row = rows[_stage_of(name, stages)]
        row["expert" if any(r.group in ("ep", "etp") for r in rules) else "dense"] += nbytes
        partial = "router.weight" in name or (parallel.sequence_parallel and ("norm" in name or "shared_gate" in name))
        if partial and not any(r.group == "tp" for r in rules):
            row["tp_partial"] += nbytes
    return rows


def _tp_stage(recipe, parallel, stage: list[int], first: bool, last: bool, act_bytes: int) -> dict[str, float]:
    """TP bytes of one micro-batch on one stage, by collective: each block (a mixer, a dense MLP,
    a shared expert) all-gathers its input and reduce-scatters its output under SP, forward and
    backward, else all-reduces its output forward and its input gradient backward; without SP the
    routed experts split the tokens over TP and all-gather the output (forward and backward); the
    embedding and the output layer one all-gather and one reduce-scatter (SP) or one all-reduce;
    cross-entropy 3 all-reduces of [b, s] fp32. Sizes are the full [b, s, h]."""
    cfg, sp = recipe.model, parallel.sequence_parallel
    tokens = recipe.train.micro_batch_size * recipe.data.seq_len / parallel.cp
    full = tokens * cfg.hidden_size * act_bytes
    layers = cfg.parsed_layout().layers
    shared = cfg.moe is not None and bool(cfg.moe.shared_ffn())
    blocks = sum(1 + (layers[i].mlp == "d" or (layers[i].mlp in MOE_LETTERS and shared)) for i in stage)
    routed = sum(layers[i].mlp in MOE_LETTERS for i in stage) if not sp else 0
    ends = first + last
    ce = 3 * tokens * 4 if last else 0.0
    if sp:
        return {"all_gather": full * (2 * blocks + ends), "reduce_scatter": full * (2 * blocks + ends),
                "all_reduce": ce}
    return {"all_gather": full * 2 * routed, "all_reduce": full * (2 * blocks + ends) + ce}


def step_bytes(recipe, parallel, world_size: int, model=None, act_bytes: int = 4) -> dict[tuple[str, str], float]:
    """{(group, collective kind): bytes} one rank puts into the step's collectives, the mean over
    ranks, as the communication monitor records them: the tokens' all-to-alls over ep
    (``ep_bytes``), TP's per-layer collectives (``_tp_stage``) and partial-gradient sums, pipeline
    sends and receives (an activation and its gradient per micro-batch and stage boundary),
    gradients all-reduced over dp_cp (dense) and edp (experts) and, with ZeRO-1, the updated
    parameters broadcast back over them; the step's scalars (token count over dp, loss over the
    world, the gradient norm over mp and emp). Models the alltoall dispatcher, etp=1, cp=1, vpp=1
    and fp32 gradients in the parameters' dtype."""
    from megamoe.planning.plan import _grid, planned_model

    cfg, g = recipe.model, _grid(parallel, world_size)
    stages = cfg.parsed_layout().stages(parallel.pp)
    model = model if model is not None else planned_model(cfg, recipe.lora)
    params = stage_param_bytes(model, parallel, world_size, stages)
    m, pp = micro_batches(recipe, parallel, world_size), parallel.pp
    out: dict[tuple[str, str], float] = {}

    def add(group: str, kind: str, nbytes: float, size: int) -> None:
        if size > 1 and nbytes:
            out[(group, kind)] = out.get((group, kind), 0.0) + nbytes

    add("ep", "all_to_all", ep_bytes(recipe, parallel, world_size, act_bytes), parallel.ep)
    zero1 = 2 if recipe.optim.zero1 else 1  # the all-reduce, and the broadcast of the updates
    for i, (stage, row) in enumerate(zip(stages, params)):
        for kind, nbytes in _tp_stage(recipe, parallel, stage, i == 0, i == len(stages) - 1, act_bytes).items():
            add("tp", kind, nbytes * m / pp, parallel.tp)
        add("tp", "all_reduce", row["tp_partial"] / pp, parallel.tp)
        add("dp_cp", "all_reduce", row["dense"] / pp, g["dp_cp"])
        add("edp", "all_reduce", row["expert"] / pp, g["edp"])
        if zero1 == 2:
            add("dp_cp", "broadcast", row["dense"] / pp, g["dp_cp"])
            add("edp", "broadcast", row["expert"] / pp, g["edp"])
    tokens = recipe.train.micro_batch_size * recipe.data.seq_len / parallel.cp
    tp_seq = parallel.tp if parallel.sequence_parallel else 1
    add("pp", "send_recv", 2 * m * tokens / tp_seq * cfg.hidden_size * act_bytes * 2 * (pp - 1) / pp, pp)
    for group, size in (("dp", g["dp"]), ("world", world_size), ("mp", parallel.tp * pp),
                        ("emp", parallel.etp * parallel.ep * pp)):
        add(group, "all_reduce", 8.0, size)
    return out


def by_group(step: dict[tuple[str, str], float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for (group, _), nbytes in step.items():
        out[group] = out.get(group, 0.0) + nbytes
    return out
