"""Fused elementwise kernels: pure tensor functions compiled with ``torch.compile``.

The layers' hand-written backwards leave chains of elementwise passes between their GEMMs
(SwiGLU and its gradient, RMSNorm, the short convolution, the L2 norm). Eager torch runs each
link as its own pass over memory; inductor compiles a chain into one loop (C++/OpenMP on CPU,
Triton on GPU). Megatron does the same with ``jit_fuser``. Only whole functions of plain
tensors are compiled, never autograd graphs: each fused function sits inside an
``autograd.Function`` whose backward calls its fused partner, and every one has an eager twin
with the same contract that runs when fusion is off.

Whether a call runs fused is the caller's ``fuse`` argument; the policy behind it is a
``Fusion`` owned by the model's backend (``model.fusion``, or ``MEGAMOE_FUSION`` when that
is unset; nothing process-wide): ``auto`` (default) fuses CPU tensors when a C++ compiler is
on PATH and leaves accelerator tensors to their own kernels (TE, fla; GPU fusion is untested
here); ``on`` fuses on every device; ``off`` never. Two models in one process may differ.
Shapes are compiled symbolically (``dynamic=True``), so changing row counts do not recompile.
The first call of each function compiles it (5-20 s per variant on 2 cores; inductor's
on-disk cache makes later processes take ~2 s). If compiling fails (no working compiler), the
function logs one warning and runs eagerly from then on; an error of the inputs themselves
(a shape mismatch) is raised as the eager function raises it.
"""
from __future__ import annotations

import contextlib

import functools
import logging
import os
import shutil

import torch

from megamoe.core.config import FUSION_MODES, check_choice

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _have_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)


class Fusion:
    """A backend's fusion policy: on which devices its fused functions run compiled."""

    def __init__(self, mode: str = "off", field: str = "model.fusion"):
        check_choice(field, mode, FUSION_MODES)
        self.mode = mode

    @classmethod
    def from_config(cls, mode: str | None) -> Fusion:
        """``model.fusion``; None: the ``MEGAMOE_FUSION`` environment variable (default auto)."""
        if mode is None:
            return cls(os.environ.get("MEGAMOE_FUSION", "auto"), "MEGAMOE_FUSION")
        return cls(mode)

    def active(self, device: torch.device) -> bool:
        """Whether fused functions run compiled for tensors on ``device``."""
        if self.mode == "off":
            return False
        return self.mode == "on" or (device.type == "cpu" and _have_cxx())

    @contextlib.contextmanager
    def eager(self):
        """Fused functions run eagerly inside: a one-token decode step is so small that a compiled
        graph's per-call cost exceeds what it saves (docs/performance.md, batched decoding)."""
        mode, self.mode = self.mode, "off"
        try:
            yield
        finally:
            self.mode = mode

    def __repr__(self) -> str:
        return f"Fusion({self.mode!r})"


EAGER = Fusion("off")  # what a module built outside a backend uses: the eager twins


# a function meets several ranks, strides and optional inputs (a norm of [b, s, h] rows and
# of [b, s, heads, d] head slices, with and without a gate); each variant is one more graph
RECOMPILE_LIMIT = 64


def _allow_variants() -> None:
    import torch._dynamo

    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT


class Fused:
    """``fn`` compiled on first call (``fn`` itself after a failed compile); ``fn`` is its
    eager twin, and ``pick(fuse)`` chooses between them."""

    def __init__(self, fn):
        self.fn, self.compiled, self.broken = fn, None, False
        functools.update_wrapper(self, fn)

    def pick(self, fuse: bool):
        return self if fuse else self.fn

    def __call__(self, *args):
        if self.broken:
            return self.fn(*args)
        if self.compiled is None:
            log.info("fusion: compiling %s (once per process; inductor caches it on disk)", self.fn.__qualname__)
            _allow_variants()
            self.compiled = torch.compile(self.fn, dynamic=True)
        # callers run inside autograd Functions: detached inputs keep requires_grad out of the guards
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        try:
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001  (compiler failures have many types)
            out = self.fn(*args)  # an error of the inputs themselves raises here, as it would eagerly
            self.broken = True
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("fusion: compiling %s failed (%s); it runs eagerly from now on", self.fn.__qualname__, first)
            return out


def fused(fn) -> Fused:
    """Decorator: ``fn`` (a pure function of tensors and Python constants) as a ``Fused``."""
    return Fused(fn)


def call(fn, *args):
    """``fn.apply(*args)`` under autograd; without it (decode steps) the function's forward maths
    ``fn.run(*args)[0]`` directly, so no autograd node is made per call."""
    if torch.is_grad_enabled():
        return fn.apply(*args)
    return fn.run(*args)[0]
