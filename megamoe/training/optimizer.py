"""AdamW with optimizer state split over data-parallel ranks (ZeRO-1), and the LR schedule.

Every data-parallel rank holds the full (already reduced) gradients, but only the owner of a
parameter keeps its Adam moments and updates it; owners then broadcast the new values.
Dense parameters are split over the data(-context)-parallel group, routed-expert parameters
over the expert-data-parallel group (their replicas). Ownership is a deterministic greedy
balance by size, so it depends only on the model and the group size: a checkpoint keys
optimizer state by parameter name and resumes at any data-parallel size.

Master weights: an owned parameter stored in less than fp32 (``model.params_dtype=bfloat16``)
gets an fp32 master copy; Adam updates the master and the parameter takes its rounded value,
so updates smaller than half a bf16 step still accumulate. ``offload`` (train.optimizer_offload)
keeps masters and Adam's moments of every owned parameter in host memory (pinned when the
model is on a GPU) and runs the update there; on a CPU machine that is the same code with
host copies. Checkpoints hold the masters of lower-precision parameters as ``optim.master``
beside the moments (an fp32 parameter is its own master), so offload can change between runs.
"""
from __future__ import annotations

import math

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megamoe.parallel import comm
from megamoe.parallel.groups import ParallelGroups, group_rank, group_size
from megamoe.training.config import OptimConfig
from megamoe.training.grads import is_expert_param


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to ``lr`` then cosine decay to ``min_lr`` (step counts from 0)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay = cfg.decay_steps or max(1, total_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / decay)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def _assign_owners(named: list[tuple[str, torch.Tensor]], n: int) -> dict[str, int]:
    """Greedy: largest first to the least loaded rank (ties by name), deterministic."""
    load = [0] * n
    owners = {}
    for name, p in sorted(named, key=lambda x: (-x[1].numel(), x[0])):
        r = min(range(n), key=lambda i: (load[i], i))
        owners[name] = r
        load[r] += p.numel()
    return owners


class DistributedOptimizer:
    """AdamW over named parameters; ``zero1`` shards its state over data-parallel ranks."""

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], groups: ParallelGroups, cfg: OptimConfig,
                 offload: bool = False):
        self.cfg = cfg
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.domains = []  # (group, [(name, param, owner)])
        mine = []
        for experts, group in ((False, groups.dp_cp), (True, groups.edp)):
            members = [(n, p) for n, p in self.named if is_expert_param(p) == experts]
            size = group_size(group) if cfg.zero1 else 1
            owners = _assign_owners(members, size)
            rank = group_rank(group) if cfg.zero1 else 0
            entries = [(n, p, owners[n]) for n, p in members]
            self.domains.append((group if cfg.zero1 else None, entries))
            mine += [(n, p) for n, p, o in entries if o == rank]
        self.owned = dict(mine)
        self.masters = {p: _master(p, offload) for _, p in mine if offload or p.dtype != torch.float32}
        stepped = [(n, self.masters.get(p, p)) for n, p in mine]  # what Adam updates
        decay = [p for n, p in stepped if p.ndim >= 2]
        no_decay = [p for n, p in stepped if p.ndim < 2]  # norms, biases, gates: no weight decay
        param_groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}]
        self.inner = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                       foreach=False)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for _, p in self.named]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for g in self.inner.param_groups:
            g["lr"] = lr
        for p, m in self.masters.items():
            m.grad = None if p.grad is None else p.grad.to(m.device, torch.float32, non_blocking=True)
        self.inner.step()
        for p, m in self.masters.items():
            p.copy_(m, non_blocking=True)   # rounded to the parameter's dtype
            m.grad = None
        self._broadcast_updates()

    def _broadcast_updates(self) -> None:
        for group, entries in self.domains:
            n = group_size(group)
            if n == 1:
                continue
            for owner in range(n):
                tensors = [p.data for _, p, o in entries if o == owner]
                if not tensors:
                    continue
                flat = _flatten_dense_tensors(tensors)
                with comm.tag_scope("optimizer"):
                    comm.broadcast_tensor(flat, owner, group)
                if owner != group_rank(group):
                    for t, new in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                        t.copy_(new)

    def owned_states(self, create: bool = False) -> dict[str, tuple[torch.Tensor, dict]]:
        """name -> (param, {exp_avg, exp_avg_sq, step}) for the parameters this rank owns.
        ``create`` materialises empty states (AdamW creates them lazily) so a checkpoint
        can be loaded into them in place."""
        out = {}
        for name, p in self.owned.items():
            key = self.masters.get(p, p)
            state = self.inner.state[key]
            if create and not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(key, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(key, memory_format=torch.preserve_format)
            if state:  # an fp32 parameter is its own master (a host copy only follows it)
                out[name] = (p, state if p.dtype == torch.float32 else {**state, "master": key})
        return out

    @torch.no_grad()
    def follow_loaded_params(self) -> None:
        """After parameters were loaded in place: the host copies of fp32 parameters follow
        them (a lower-precision parameter's master was loaded from the checkpoint itself)."""
        for p, m in self.masters.items():
            if p.dtype == torch.float32:
                m.copy_(p)


def _master(p: torch.Tensor, offload: bool) -> torch.Tensor:
    """An fp32 copy of ``p``: beside it, or in host memory (pinned for a GPU model)."""
    m = p.detach().to(device="cpu" if offload else p.device, dtype=torch.float32, copy=True)
    return m.pin_memory() if offload and p.device.type == "cuda" else m
