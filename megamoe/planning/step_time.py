"""Estimated step time of a layout: GEMM FLOPs at a device rate plus the step's collectives at
the bandwidth of the links they cross.

    compute = 6 x active matmul parameters x tokens per step / world / rate x (1 + (pp - 1) / m)
    comm    = sum over (group, collective) of bytes x bus factor(n) / bandwidth(group)

Bytes per group come from ``megamoe.planning.traffic.step_bytes`` (the communication monitor's
accounting); the bus factor is nccl-tests' (``megamoe.diagnostics.comm_profile.BUS_FACTOR``:
what each rank sends over the wire). A group inside a node runs at ``intra_gbps``, one across
nodes at ``inter_gbps``; an EP group over several nodes sends its remote share at the latter.
Nothing overlaps (an upper bound: overlapping the dispatch with the shared expert and the
gradient reduction with the backward hides part of ``comm``); the pipeline bubble of 1F1B with
``m`` micro-batches is ``(pp - 1) / m`` of the compute. Attention's score FLOPs are left out.
"""
from __future__ import annotations

from dataclasses import dataclass

from megamoe.diagnostics.comm_profile import BUS_FACTOR
from megamoe.parallel.topology import nodes_spanned, remote_share
from megamoe.planning.traffic import micro_batches, step_bytes

BUS = {**BUS_FACTOR, "broadcast": lambda n: 1.0}  # nccl-tests: a broadcast's bus bandwidth is its algorithm bandwidth


@dataclass
class Hardware:
    tflops: float = 400.0  # achieved dense bf16 GEMM rate per GPU (an H100 at ~40% of its 989 peak)
    intra_gbps: float = 450.0  # per-GPU bandwidth inside a node (NVLink), GB/s
    inter_gbps: float = 50.0  # per-GPU bandwidth between nodes (400 Gb/s InfiniBand), GB/s


def _sizes(parallel, world_size: int) -> dict[str, int]:
    from megamoe.planning.plan import _grid

    g = _grid(parallel, world_size)
    return {**g, "pp": parallel.pp, "world": world_size, "mp": parallel.tp * parallel.pp,
            "emp": parallel.etp * parallel.ep * parallel.pp}


def _seconds_per_byte(group: str, parallel, world_size: int, node: int, hw: Hardware) -> float:
    intra, inter = 1 / (hw.intra_gbps * 1e9), 1 / (hw.inter_gbps * 1e9)
    if group == "ep":
        share = remote_share(parallel, node)
        return (1 - share) * intra + share * inter
    if group == "tp":
        return intra
    stage = world_size // parallel.pp  # dp, edp and the step's scalars live inside a stage's ranks
    inside = {"pp": world_size <= node, "world": world_size <= node}.get(group, nodes_spanned(stage, node) == 1)
    return intra if inside else inter


def step_time(recipe, parallel, world_size: int, node: int, hw: Hardware, model=None,
              act_bytes: int = 2) -> dict:
    """{"compute": s, "comm": {group: s}, "step": s, "comm_share": fraction} for one step."""
    from megamoe.model.params import count_parameters
    from megamoe.planning.plan import planned_model

    model = model if model is not None else planned_model(recipe.model, recipe.lora)
    b = count_parameters(model)
    embed = b.parts.get("embedding", (0, 0.0))[1] if not recipe.model.tie_embeddings else 0.0
    tokens = recipe.train.global_batch_size * recipe.data.seq_len
    bubble = 1 + (parallel.pp - 1) / micro_batches(recipe, parallel, world_size)
    compute = 6.0 * (b.active - embed) * tokens / world_size / (hw.tflops * 1e12) * bubble
    sizes, comm = _sizes(parallel, world_size), {}
    for (group, kind), nbytes in step_bytes(recipe, parallel, world_size, model, act_bytes).items():
        wire = nbytes * BUS[kind](sizes[group])
        comm[group] = comm.get(group, 0.0) + wire * _seconds_per_byte(group, parallel, world_size, node, hw)
    total = compute + sum(comm.values())
    return {"compute": compute, "comm": comm, "step": total, "comm_share": sum(comm.values()) / total}


def rank_layouts(recipe, world_size: int, fits: list[tuple[dict, float]], node: int, hw: Hardware,
                 most: int = 10) -> list[tuple[dict, float, dict]]:
    """(degrees, busiest rank's bytes, ``step_time``) of the ``fits`` (``fitting_layouts``) whose
    groups the node size allows (TP inside a node), fastest first."""
    import dataclasses

    from megamoe.core.errors import ConfigError
    from megamoe.parallel.topology import check_topology
    from megamoe.planning.plan import planned_model

    model, out = planned_model(recipe.model, recipe.lora), []
    for degrees, worst in fits:
        par = dataclasses.replace(recipe.parallel, **degrees, etp=1, cp=1, vpp=1, sequence_parallel=degrees["tp"] > 1)
        try:
            check_topology(par, world_size, node)
        except ConfigError:
            continue
        out.append((degrees, worst, step_time(recipe, par, world_size, node, hw, model)))
    return sorted(out, key=lambda x: x[2]["step"])[:most]


def describe_time(t: dict) -> str:
    """``step 12.3 s, comm 34% (ep 20%, dp_cp 10%, ...)``: the groups taking 1% or more."""
    parts = sorted(((s / t["step"], g) for g, s in t["comm"].items()), reverse=True)
    groups = ", ".join(f"{g} {share:.0%}" for share, g in parts if share >= 0.01)
    return f"step {t['step']:.3g} s, comm {t['comm_share']:.0%}" + (f" ({groups})" if groups else "")
