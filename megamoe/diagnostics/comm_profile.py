"""Communication profile of a parallel layout: latency percentiles and bandwidth of the
collectives megamoe issues, per process group and message size, measured before training.

Each group kind runs the operations megamoe uses on it (``GROUP_OPS``): TP linears all-reduce,
all-gather and reduce-scatter; the pipeline sends activations to the next stage; gradients are
all-reduced over dp_cp (dense) and edp (experts); MoE tokens go all-to-all over ep (tp_ep when
TP and EP combine); expert-tensor linears gather and reduce-scatter over etp.

Every rank walks the same (group, operation, size) list, so all groups of a kind (e.g. every
TP group of the grid) run at once, as in training. One sample: a barrier of the group, then the
operation timed on each rank; a sample's latency is the slowest rank's (an all-reduce of MAX),
so every rank reports the same numbers. Bandwidth is the bus bandwidth of nccl-tests:
bytes / p50 x the fraction of the data each rank sends over the wire (all-reduce 2(n-1)/n;
all-gather, reduce-scatter, all-to-all (n-1)/n; send/recv 1).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megamoe.core.errors import ConfigError
from megamoe.parallel.groups import ParallelGroups

GROUP_OPS = {
    "tp": ("all_reduce", "all_gather", "reduce_scatter"),
    "pp": ("send_recv",),
    "dp_cp": ("all_reduce", "all_gather", "reduce_scatter"),
    "ep": ("all_to_all",),
    "tp_ep": ("all_to_all",),
    "etp": ("all_gather", "reduce_scatter"),
    "edp": ("all_reduce",),
}
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "send_recv": lambda n: 1.0}
UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
         "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


@dataclass
class Row:
    group: str
    op: str
    ranks: int
    bytes: int
    p50: float  # seconds
    p90: float
    p99: float

    @property
    def busbw(self) -> float:
        """GB/s at the median latency."""
        return self.bytes * BUS_FACTOR[self.op](self.ranks) / max(self.p50, 1e-12) / 1e9

    def __str__(self) -> str:
        return (f"{self.group:6s} {self.op:14s} {self.ranks:5d} {human(self.bytes):>9s} {self.p50 * 1e6:10.1f} "
                f"{self.p90 * 1e6:10.1f} {self.p99 * 1e6:10.1f} {self.busbw:9.3f}")


HEADER = f"{'group':6s} {'op':14s} {'ranks':>5s} {'bytes':>9s} {'p50_us':>10s} {'p90_us':>10s} {'p99_us':>10s} {'busbw_GB/s':>9s}"


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def parse_sizes(text: str) -> list[int]:
    """``4KiB,1MiB,16M`` -> bytes (multiples of 4: fp32 elements)."""
    sizes = []
    for item in text.split(","):
        item = item.strip()
        digits = item.rstrip("KMGIBkmgib")
        try:
            n = int(float(digits) * UNITS[item[len(digits):].upper()])
        except (ValueError, KeyError):
            raise ConfigError(f"--sizes {text}: {item!r} is not a size (e.g. 4KiB, 1MiB)") from None
        if n < 4:
            raise ConfigError(f"--sizes {text}: {item!r} is below one fp32 element (4 bytes)")
        sizes.append(n)
    return sizes


def operation(op: str, group, x: torch.Tensor):
    """A callable running ``op`` once on ``x`` (flat fp32, divisible by the group size)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        out = x.new_empty(x.numel() * n)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if op == "reduce_scatter":
        out = x.new_empty(x.numel() // n)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if op == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    ranks = dist.get_process_group_ranks(group)  # send_recv: a ring, each stage to the next
    nxt, prv, buf = ranks[(me + 1) % n], ranks[(me - 1) % n], torch.empty_like(x)

    def send_recv():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, group),
                                            dist.P2POp(dist.irecv, buf, prv, group)]):
            work.wait()
    return send_recv


def measure(op: str, group, nbytes: int, iters: int, warmup: int, device) -> torch.Tensor:
    """[iters] seconds, the slowest rank's per sample."""
    n = dist.get_world_size(group)
    elems = max(n, nbytes // 4 // n * n)
    run = operation(op, group, torch.ones(elems, device=device))
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(warmup + iters):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times[i - warmup] = time.perf_counter() - t0
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return times.cpu()


def profile(groups: ParallelGroups, sizes: list[int], iters: int = 20, warmup: int = 3, device=None) -> list[Row]:
    """Every group of this rank's grid (size > 1) x its operations x ``sizes``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for name, ops in GROUP_OPS.items():
        group = getattr(groups, name)
        if group is None:
            continue
        n = dist.get_world_size(group)
        for op in ops:
            for nbytes in sizes:
                t = measure(op, group, nbytes, iters, warmup, device)
                q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=t.dtype)).tolist()
                elems = max(n, nbytes // 4 // n * n)
                rows.append(Row(name, op, n, elems * 4, *q))
    return rows
