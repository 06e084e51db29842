"""Encoder weights from local files, offline: read, remap with timm's filter, load strictly.

``read_tensors`` reads a safetensors file, a torch file (``weights_only=True``) or every
``*.safetensors`` file of a directory, keeping only names that start with ``prefix`` (so
the vision tower of a huge VLM checkpoint is read without its language model).
``load_encoder_weights`` passes them through the timm model's checkpoint filter (e.g.
``qwen3_vit``'s ``checkpoint_filter_fn_encoder`` remaps HF ``model.visual.*`` names) and
loads them with strict name and shape matching; any mismatch is a one-line error.
"""
from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import torch
from torch import nn

from megamoe.core.errors import CheckpointError, ConfigError


def _take(name: str, prefix: str | None) -> bool:
    return prefix is None or name.startswith(prefix)


def _read_safetensors(file: Path, prefix: str | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if _take(k, prefix)}


def _read_torch(file: Path, prefix: str | None) -> dict[str, torch.Tensor]:
    obj = torch.load(file, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model", "module"):  # common wrappers around a state dict
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{file}: holds a {type(obj).__name__}, not a state dict")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor) and _take(k, prefix)}


def read_tensors(path: str | Path, prefix: str | None = None, field: str = "model.vision.weights"
                 ) -> dict[str, torch.Tensor]:
    """Tensors whose name starts with ``prefix`` from a file or a directory of safetensors."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{field}={str(path)!r}: no such file or directory")
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise CheckpointError(f"{field}={str(path)!r}: directory holds no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(_read_safetensors(f, prefix) if f.suffix == ".safetensors" else _read_torch(f, prefix))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001  (corrupt files raise many kinds; report one line)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{f}: cannot read tensors ({first})") from None
    if not out:
        raise CheckpointError(f"{field}={str(path)!r}: no tensor name starts with weights_prefix={prefix!r}")
    return out


def resolve_filter(model: nn.Module, spec: str, field: str = "model.vision.weights_filter"):
    """The state-dict filter for ``model``: ``none``; ``auto`` (the ``checkpoint_filter_fn`` of
    the model's timm module, its ``_encoder`` variant for encoder classes); or a dotted path."""
    if spec == "none":
        return None
    if spec == "auto":
        module = sys.modules[type(model).__module__]
        names = ["checkpoint_filter_fn"]
        if type(model).__name__.endswith("Encoder"):
            names.insert(0, "checkpoint_filter_fn_encoder")
        return next((getattr(module, n) for n in names if hasattr(module, n)), None)
    module_name, _, attr = spec.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"{field}={spec!r} is invalid: allowed: auto, none or a dotted path to a "
                          "filter function (state_dict, model) -> state_dict") from None


def apply_filter(fn, state: dict, model: nn.Module) -> dict:
    takes_model = len(inspect.signature(fn).parameters) >= 2
    return fn(state, model) if takes_model else fn(state)


@torch.no_grad()
def load_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load with every name and shape matching; the first mismatch is a one-line error."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing:
        raise CheckpointError(f"{source}: lacks tensor {missing[0]} for the encoder ({len(missing)} missing)")
    if extra:
        raise CheckpointError(f"{source}: tensor {extra[0]} matches nothing in the encoder ({len(extra)} unused)")
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise CheckpointError(f"{source}: tensor {name} has shape {list(t.shape)}, the encoder expects "
                                  f"{list(own[name].shape)} (check model.vision.encoder_args)")
    model.load_state_dict(state, strict=True)


def load_encoder_weights(model: nn.Module, path: str, prefix: str | None = None, filter_spec: str = "auto"
                         ) -> None:
    state = read_tensors(path, prefix)
    fn = resolve_filter(model, filter_spec)
    if fn is not None:
        state = apply_filter(fn, state, model)
    load_strict(model, state, f"model.vision.weights={path!r}")
