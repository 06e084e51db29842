"""Backends fill the roles a layer asks for; the registry says which exist and picks one.

A layer never branches on parallelism, on the device or on the backend: it asks
``ctx.backend`` for a role (a linear, a norm, an attention core, a linear-attention op, the
short convolution, the experts, the router GEMM, ...) and uses what it gets. Three backends
ship here:

- ``local``: the pure-torch reference of every role (plain autograd ops, the recurrent form
  of the linear-attention ops, the per-expert reference loop); runs on any device;
- ``cpu``: the CPU fast paths (hand-written backwards, the chunked linear-attention ops, the
  expert loop kernel and the fused shared expert, with the elementwise chains compiled per
  its ``Fusion``). Its ops are plain torch too, so it runs on any device;
- ``cuda``: fla's Triton ops for the linear-attention mixers, torch's grouped GEMM for the
  experts, and torch-native FP8 GEMMs (``train.fp8=torch``); needs a CUDA device;
- ``te``: ``cuda`` with the linear GEMMs run by Transformer Engine under its FP8 recipes
  (``train.fp8=delayed|current|blockwise|mxfp8``); needs CUDA and ``transformer_engine``.

``model.backend=auto`` (the default) is ``cuda`` where CUDA is present and ``cpu`` otherwise.
A new backend registers a factory ``fusion -> backend``, optionally a probe that names what
is missing where it cannot run, and the FP8 recipes it has (``factory(fusion, fp8=...)``)::

    register_backend("te", TEBackend, missing=lambda: None if have_te() else "transformer_engine is not installed",
                     fp8=("delayed", "current", "blockwise", "mxfp8"))
"""
from __future__ import annotations

from typing import Callable

import torch

from megamoe.core.errors import ConfigError
from megamoe.layers.ops.fusion import EAGER, Fusion
from megamoe.layers.backends.cpu import CpuBackend
from megamoe.layers.backends.cuda import FP8_RECIPES, CudaBackend, missing as cuda_missing
from megamoe.layers.backends.local import LocalBackend
from megamoe.layers.backends.te import TE_RECIPES, TEBackend, missing as te_missing

_REGISTRY: dict[str, tuple[Callable, Callable[[], str | None] | None, tuple[str, ...]]] = {}


def register_backend(name: str, factory: Callable, *, missing: Callable[[], str | None] | None = None,
                     fp8: tuple[str, ...] = ()) -> None:
    """``factory(fusion)`` builds an instance (``factory(fusion, fp8=recipe)`` for one of the
    FP8 recipes in ``fp8``); ``missing()`` returns None where the backend can run, else what it
    lacks (one short phrase)."""
    _REGISTRY[name] = (factory, missing, tuple(fp8))


def backend_names() -> list[str]:
    return list(_REGISTRY)


def available_backends() -> list[str]:
    """The registered backends that can run here."""
    return [n for n, (_, missing, _) in _REGISTRY.items() if missing is None or missing() is None]


def resolve_backend_name(name: str) -> str:
    """``auto`` -> ``cuda`` where CUDA is present, else ``cpu``."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_backend(name: str = "auto", fusion: Fusion = EAGER, field: str = "model.backend", *,
                fp8: str | None = None):
    """A new backend instance owning ``fusion`` (and running ``fp8``'s recipe); a one-line
    ConfigError for an unknown name, a backend that cannot run here, or an FP8 recipe the
    backend does not have."""
    resolved = resolve_backend_name(name)
    if resolved not in _REGISTRY:
        raise ConfigError(f"{field}={name!r} is not a backend: allowed: auto, {', '.join(_REGISTRY)}")
    factory, missing, recipes = _REGISTRY[resolved]
    # a recipe the backend does not have is wrong on every machine: said before what this one lacks
    if fp8 is not None and fp8 not in recipes:
        offer = ", ".join(f"{n} ({'|'.join(r)})" for n, (_, _, r) in _REGISTRY.items() if r) or "none"
        raise ConfigError(f"train.fp8={fp8!r} is not available on the {resolved} backend; "
                          f"backends with FP8: {offer}")
    why = missing() if missing is not None else None
    if why:
        raise ConfigError(f"{field}={name!r} is unavailable here: {why}")
    return factory(fusion) if fp8 is None else factory(fusion, fp8=fp8)


register_backend("local", LocalBackend)
register_backend("cpu", CpuBackend)
register_backend("cuda", CudaBackend, missing=cuda_missing, fp8=FP8_RECIPES)
register_backend("te", TEBackend, missing=te_missing, fp8=TE_RECIPES)
