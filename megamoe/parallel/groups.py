"""The process-group grid, built once by megatron-core and passed to modules explicitly.

No module reads a global group: each receives a ``ParallelGroups`` and uses the field it
needs. ``None`` stands for a group of one (no communication), so single-process code and
meta-device builds need no ``torch.distributed`` at all.
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist

from megamoe.core.config import ParallelConfig
from megamoe.core.errors import ConfigError
from megamoe.parallel.topology import check_topology

# process group -> its names in the grid ("dp_cp", or "dp+dp_cp" when two fields share one
# group), for the communication monitor; kept as long as the grid (see _GRIDS, release_groups)
_NAMES: dict[int, str] = {}


def group_name(group) -> str:
    """The grid name of ``group`` (``tp``, ``ep``, ``dp_cp``, ...), ``world``, or ``group<size>``
    for a group megamoe's grid did not create."""
    name = _NAMES.get(id(group))
    if name is not None:
        return name
    if group is None or group is dist.group.WORLD:
        return "world"
    return f"group{group_size(group)}"


def _name_groups(groups: ParallelGroups) -> None:
    names: dict[int, list[str]] = {}
    for f in fields(groups):
        group = getattr(groups, f.name)
        if group is not None:
            names.setdefault(id(group), []).append(f.name)
    _NAMES.update({k: "+".join(v) for k, v in names.items()})


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class ParallelGroups:
    """Explicit groups of one rank's position in the grid (``None`` = size one).

    tp: tensor parallel; pp: pipeline; dp: data parallel (without CP); cp: context parallel;
    dp_cp: data x context (gradients of dense params are averaged over it);
    ep: expert parallel; etp: expert tensor parallel; edp: expert data parallel
    (gradients of expert params are averaged over it); tp_ep: expert-tensor x expert (MoE
    token exchange when TP and EP are combined); mp: tensor x pipeline and emp: expert-tensor
    x expert x pipeline (gradient norms sum over them); embd: first and last pipeline stage
    (tied embedding gradients); amax: tensor x data x context of one pipeline stage (FP8
    scaling statistics are reduced over it, megatron-core's amax reduction group).
    """

    tp: object = None
    pp: object = None
    dp: object = None
    cp: object = None
    dp_cp: object = None
    ep: object = None
    etp: object = None
    edp: object = None
    tp_ep: object = None
    mp: object = None
    emp: object = None
    embd: object = None
    amax: object = None

    def size(self, name: str) -> int:
        return group_size(getattr(self, name))

    def rank(self, name: str) -> int:
        return group_rank(getattr(self, name))

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def tp_rank(self) -> int:
        return self.rank("tp")

    def describe(self) -> str:
        return " ".join(f"{f.name}={self.rank(f.name)}/{self.size(f.name)}" for f in fields(self))


def dist_backend(device=None) -> str:
    """The collective backend for a run on ``device``: NCCL for CUDA, gloo otherwise. The run's
    device decides, not CUDA's presence: a CPU run on a GPU machine (the CPU reference of a GPU
    test) holds CPU tensors, which NCCL cannot reduce. None: CUDA where present."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(backend: str | None = None, timeout_minutes: int = 30, device=None) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (``dist_backend(device)`` unless
    ``backend`` is given).

    Returns (rank, world_size). A single process without torchrun's variables gets a world
    of one over an in-process store, so no port is taken (two such runs side by side do not
    collide); MASTER_ADDR/MASTER_PORT, when set, are honoured instead.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or dist_backend(device)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=timeout_minutes)
    if world == 1 and "MASTER_PORT" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # a restarted worker group meets on the same agent store as the one before it, under the
        # same group names: give each round its own key space, or gloo reads the dead workers'
        # addresses. The round is counted in the store (every worker joins once per round); the
        # agents' restart counts differ between nodes, so they cannot name it.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timeout)
        round_ = (store.add("megamoe/joins", 1) - 1) // world
        dist.init_process_group(backend, store=dist.PrefixStore(f"megamoe/round_{round_}", store), rank=rank,
                                world_size=world, timeout=timeout)
        return rank, world
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return rank, world


def _parallel_state():
    # megatron-core warns at import that TE/apex are absent, and its NCCL allocator's import of
    # torch.utils.cpp_extension logs "No CUDA runtime is found" on CPU machines; megamoe uses
    # neither part, and the lines would precede every one-line error of a CPU run
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_log.level
    cpp_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state
    finally:
        cpp_log.setLevel(level)
    return parallel_state


# grids already built in this process, by layout: megatron-core never destroys the process
# groups it creates (each holds communication threads), so a layout is built once and reused
_GRIDS: dict[tuple, ParallelGroups] = {}


def build_groups(parallel: ParallelConfig, timeout_s: float | None = None) -> ParallelGroups:

    """Create the grid with megatron-core's ``initialize_model_parallel`` and collect its groups.

    Requires torch.distributed to be initialised (see ``init_distributed``). A process can
    switch layouts (tests do); each layout's groups are created once and reused.
    """
    if not dist.is_initialized():
        raise ConfigError("parallel: torch.distributed is not initialised (call init_distributed first)")
    world = dist.get_world_size()
    parallel.validate(world)
    check_topology(parallel, world)  # TP/ETP inside a node (refused otherwise, before any group exists)
    # a layout's groups are built once per process, with the collective timeout first asked for
    key = (id(dist.group.WORLD), world, parallel.tp, parallel.pp, parallel.vpp, parallel.cp, parallel.ep, parallel.etp)
    if key not in _GRIDS:
        _GRIDS[key] = _build(parallel, timeout_s)
        _name_groups(_GRIDS[key])
    return _GRIDS[key]


def release_groups() -> int:
    """Destroy every process group of this process except the default (world) one: the grids
    ``build_groups`` cached and megatron-core's state with them. Returns how many were destroyed.

    For long-lived processes that switch layouts (the test suite's worker pools): each gloo group
    keeps a transport thread that wakes every 10 ms, so hundreds of dead layouts' groups cost a
    core. Models built on a released grid must not be used afterwards.
    """
    if not dist.is_initialized():
        return 0
    ps = _parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _GRIDS.clear()
    _NAMES.clear()
    # megatron-core keeps no list of the groups it made; torch's registry is the only complete one
    groups = [g for g in list(dist.distributed_c10d._world.pg_map) if g is not dist.group.WORLD]
    for group in groups:
        dist.destroy_process_group(group)
    return len(groups)


def _build(parallel: ParallelConfig, timeout_s: float | None = None) -> ParallelGroups:
    ps = _parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        create_gloo_process_groups=False,
        # how long a collective waits for its peers (megatron-core's default: 30 minutes)
        **({} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}),
    )

    def one(group):
        return None if group is None or dist.get_world_size(group) == 1 else group

    return ParallelGroups(
        tp=one(ps.get_tensor_model_parallel_group()),
        pp=one(ps.get_pipeline_model_parallel_group()),
        dp=one(ps.get_data_parallel_group()),
        cp=one(ps.get_context_parallel_group()),
        dp_cp=one(ps.get_data_parallel_group(with_context_parallel=True)),
        ep=one(ps.get_expert_model_parallel_group()),
        etp=one(ps.get_expert_tensor_parallel_group()),
        edp=one(ps.get_expert_data_parallel_group()),
        tp_ep=one(ps.get_expert_tensor_and_model_parallel_group()),
        mp=one(ps.get_model_parallel_group()),
        emp=one(ps.get_expert_tensor_model_pipeline_parallel_group()),
        embd=one(ps.get_embedding_group()) if ps.is_rank_in_embedding_group() else None,
        amax=one(ps.get_amax_reduction_group(with_context_parallel=True)),
    )

