"""Where the grid's groups fall on nodes.

megatron-core numbers the grid ``tp-cp-ep-dp-pp`` (dense) and ``etp-ep-edp-pp`` (experts), the
first the fastest-varying: a TP group is ``tp`` consecutive ranks, an expert-parallel group
spans ``etp * ep`` consecutive ranks. A launcher gives a node consecutive ranks
(``gpus_per_node`` of them), so a group of ``block`` consecutive ranks stays inside a node
exactly when ``block`` divides ``gpus_per_node``. That is the rule here:

- TP and ETP (an all-reduce or gather in every layer, on the critical path) must stay inside a
  node: a layout that puts them across nodes is refused in one line;
- EP should: a layout that spreads an EP group over several nodes runs, and the trainer logs
  the traffic it puts on the network (``megamoe.planning.traffic``);
- CP, DP, PP and expert-DP cross nodes as they must (ring exchanges, one gradient reduction
  per step, point-to-point between stages).

``check_topology`` applies the rule before the groups exist (the planner and ``build_groups``);
``group_nodes`` reads the nodes each built group really spans (the check that megatron-core's
numbering is the one assumed).
"""
from __future__ import annotations

import os

import torch.distributed as dist

from megamoe.core.config import ParallelConfig
from megamoe.core.errors import ConfigError


def node_size(parallel: ParallelConfig, world_size: int) -> int:
    """GPUs per node: ``parallel.gpus_per_node``, else the launcher's LOCAL_WORLD_SIZE (torchrun
    sets it), else the whole world (one node)."""
    if parallel.gpus_per_node is not None:
        return parallel.gpus_per_node
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) or world_size


def nodes_spanned(block: int, node: int) -> int:
    """Nodes one group of ``block`` consecutive ranks touches (groups aligned at multiples of block)."""
    if node % block == 0:
        return 1
    if block % node == 0:
        return block // node
    return -(-block // node) + 1  # straddles unaligned boundaries: at most this many


def check_topology(parallel: ParallelConfig, world_size: int, node: int | None = None) -> dict[str, int]:
    """Refuse TP or ETP across nodes (one line); return the nodes each grid group kind spans:
    ``{"tp": 1, "etp": 1, "ep": n, "tp_cp": m}``."""
    node = node or node_size(parallel, world_size)
    if node < 1 or world_size % node:
        raise ConfigError(f"parallel.gpus_per_node={node} is invalid: must divide the world size {world_size}")
    for name in ("tp", "etp"):
        size = getattr(parallel, name)
        if node % size:
            raise ConfigError(f"parallel.{name}={size} is invalid: it would put tensor parallelism across nodes "
                              f"of {node} GPUs (parallel.gpus_per_node); use a size dividing {node}")
    return {"tp": 1, "etp": 1, "ep": nodes_spanned(parallel.etp * parallel.ep, node),
            "tp_cp": nodes_spanned(parallel.tp * parallel.cp, node)}


def group_nodes(group, node: int) -> int:
    """Nodes the built ``group`` (None: this rank alone) really spans, ranks numbered node-major."""
    if group is None:
        return 1
    return len({r // node for r in dist.get_process_group_ranks(group)})


def remote_share(parallel: ParallelConfig, node: int) -> float:
    """The share of an EP group's peers on other nodes (what of a uniform all-to-all leaves the node)."""
    block = parallel.etp * parallel.ep
    if node % block == 0:
        return 0.0
    return 1.0 - min(node, block) / block
