"""A model family: how an HF config maps to a ``ModelConfig`` and back, and its mapping table.

Families register under their HF ``model_type``; ``get_family`` finds one for a config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megamoe.core.config import ModelConfig
from megamoe.convert.table import Rule
from megamoe.core.errors import CheckpointError


FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
WITH_FP8 = FLOAT_DTYPES | {"F8_E4M3"}  # + block-scaled e4m3 (megamoe.convert.quant)


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # HF class written to config.json "architectures"
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig, dict | None], dict]  # (cfg, original HF config or None)
    rules: Callable[[ModelConfig, dict], list[Rule]]
    notes: str = ""
    # HF tensors deliberately left out, and why: (config, tensor names) -> (names, one-line reason),
    # e.g. a vision tower megamoe cannot express; the import logs the reason instead of failing
    skipped: Callable[[dict, set[str]], tuple[set[str], str]] | None = None
    # safetensors dtypes the table's transforms take for a floating-point megamoe tensor; integer
    # or quantised (F8, I8 ...) weights need their scales applied: a family whose released
    # checkpoints ship FP8 lists F8_E4M3 (WITH_FP8), read through megamoe.convert.quant
    weight_dtypes: frozenset = FLOAT_DTYPES

    @property
    def maps_fp8(self) -> bool:
        return "F8_E4M3" in self.weight_dtypes


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def get_family(model_type: str | None, source: str = "config.json") -> Family:
    import megamoe.convert.families  # noqa: F401  (registers every family)

    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise CheckpointError(f"{source}: model_type={model_type!r} is not supported (known: {known})")
    return FAMILIES[model_type]


def hf_get(hf: dict, key: str, default=None, required: bool = True):
    """A field of an HF config; a missing required one is a one-line error naming it."""
    if key in hf and hf[key] is not None:
        return hf[key]
    if required and default is None:
        raise CheckpointError(f"config.json: field {key!r} is missing for model_type={hf.get('model_type')!r}")
    return default
