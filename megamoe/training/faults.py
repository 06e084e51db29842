"""Faults at scale: a collective that never completes becomes one line naming the step, the
part of the step and its process groups, instead of a hang or a backend traceback.

The backends give up after the process-group timeout (``train.collective_timeout_s``, passed
to ``init_process_group`` and to megatron-core's groups): gloo raises, NCCL's watchdog aborts
the communicator. The trainer records which part of the step it is in (``Phase``); a failure
there is reported with that part's groups. Under ``torchrun --max-restarts N`` the failed job
restarts and resumes from the latest complete checkpoint.
"""
from __future__ import annotations

from megamoe.core.errors import MegamoeError

# which process groups each part of a training step communicates over
PHASE_GROUPS = {
    "token count": ("dp_cp",),
    "forward/backward": ("tp", "pp", "cp", "ep", "etp", "tp_ep"),
    "gradient sync": ("dp_cp", "edp", "embd"),
    "gradient norm": ("mp", "emp", "dp_cp", "edp"),
    "optimizer step": ("dp_cp", "edp"),
    "loss reduction": ("world",),
    "metrics report": ("world",),
    "checkpoint save": ("world",),
}
_SIGNS = ("timed out", "timeout", "connection closed by peer", "connection reset", "nccl", "gloo", "socket")


class CollectiveFailure(MegamoeError):
    """A collective did not complete: a peer rank is hung or gone."""


def is_collective_failure(e: BaseException) -> bool:
    """A backend error of a collective (DistBackendError, or gloo's RuntimeErrors)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistBackendError", ())):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(s in text for s in _SIGNS)


def describe(e: BaseException, step: int, phase: str, groups, rank: int, timeout_s: float) -> CollectiveFailure:
    """The one-line error: step, part of the step, its groups larger than one, the cause."""
    names = [g for g in PHASE_GROUPS.get(phase, ("world",)) if g == "world" or groups.size(g) > 1] or ["world"]
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return CollectiveFailure(f"step {step}: a collective in {phase} (group {', '.join(names)}) failed on rank {rank} "
                             f"within train.collective_timeout_s={timeout_s:g}: {first}; a peer rank is hung or gone")
