"""Backends fill the roles a layer asks for; the registry says which exist and picks one.

A layer never branches on parallelism, on the device or on the backend: it asks
``ctx.backend`` for a role (a linear, a norm, an attention core, a linear-attention op, the
short convolution, the experts, the router GEMM, ...) and uses what it gets. Two backends
ship here:

- ``local``: the pure-torch reference of every role (plain autograd ops, the recurrent form
  of the linear-attention ops, the per-expert reference loop); runs on any device;
- ``cpu``: the CPU fast paths (hand-written backwards, the chunked linear-attention ops, the
  expert loop kernel and the fused shared expert, with the elementwise chains compiled per
  its ``Fusion``). Its ops are plain torch too, so it runs on any device.

``model.backend=auto`` (the default) is ``cpu`` on a machine without CUDA and ``local``
otherwise. A new backend registers a factory ``fusion -> backend`` and, optionally, a probe
that names what is missing where it cannot run::

    register_backend("te", TEBackend, missing=lambda: None if have_te() else "transformer_engine is not installed")
"""
from __future__ import annotations

from typing import Callable

import torch

from megamoe.errors import ConfigError
from megamoe.fusion import EAGER, Fusion
from megamoe.layers.backends.cpu import CpuBackend
from megamoe.layers.backends.local import LocalBackend

_REGISTRY: dict[str, tuple[Callable, Callable[[], str | None] | None]] = {}


def register_backend(name: str, factory: Callable, *, missing: Callable[[], str | None] | None = None) -> None:
    """``factory(fusion)`` builds an instance; ``missing()`` returns None where the backend can
    run, else what it lacks (one short phrase)."""
    _REGISTRY[name] = (factory, missing)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def available_backends() -> list[str]:
    """The registered backends that can run here."""
    return [n for n, (_, missing) in _REGISTRY.items() if missing is None or missing() is None]


def resolve_backend_name(name: str) -> str:
    """``auto`` -> ``cpu`` without CUDA, ``local`` with it (until a GPU backend registers)."""
    if name != "auto":
        return name
    return "local" if torch.cuda.is_available() else "cpu"


def get_backend(name: str = "auto", fusion: Fusion = EAGER, field: str = "model.backend"):
    """A new backend instance owning ``fusion``; a one-line ConfigError for an unknown name or
    a backend that cannot run here."""
    resolved = resolve_backend_name(name)
    if resolved not in _REGISTRY:
        raise ConfigError(f"{field}={name!r} is not a backend: allowed: auto, {', '.join(_REGISTRY)}")
    factory, missing = _REGISTRY[resolved]
    why = missing() if missing is not None else None
    if why:
        raise ConfigError(f"{field}={name!r} is unavailable here: {why}")
    return factory(fusion)


register_backend("local", LocalBackend)
register_backend("cpu", CpuBackend)
