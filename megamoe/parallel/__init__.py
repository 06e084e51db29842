"""Parallelism over megatron-core's process-group grid, device-agnostic."""
from megamoe.parallel.groups import ParallelGroups, build_groups, init_distributed  # noqa: F401
