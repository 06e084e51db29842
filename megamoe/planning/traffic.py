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
