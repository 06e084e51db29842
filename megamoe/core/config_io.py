"""Typed configs as plain data and back: dicts (meta.json), YAML (a run's record), one-line errors.

A config is a dataclass of ``megamoe.core.config`` or of a component's ``config`` module;
OmegaConf checks types and keys on the way in.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megamoe.core.config import ModelConfig
from megamoe.core.errors import ConfigError


def one_line(err: OmegaConfBaseException, source: str) -> ConfigError:
    """OmegaConf's multi-line error as one line naming ``source`` and the key."""
    key = getattr(err, "full_key", None) or ""
    msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    where = f"{key}: " if key and key not in msg else ""
    return ConfigError(f"{source}: {where}{msg}")


def config_to_dict(config: Any) -> dict:
    """A dataclass config as plain data (JSON/YAML-able)."""
    return OmegaConf.to_container(OmegaConf.structured(config))


def config_from_dict(data: dict, schema: type = ModelConfig) -> Any:
    """The inverse of ``config_to_dict``, type-checked against ``schema``."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), data))
    except OmegaConfBaseException as e:
        raise one_line(e, schema.__name__) from None


def to_yaml(config: Any) -> str:
    """The YAML record of a config (dataclass or OmegaConf)."""
    if dataclasses.is_dataclass(config):
        config = OmegaConf.structured(config)
    return OmegaConf.to_yaml(config)
