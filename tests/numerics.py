"""Numeric comparison helpers shared by tests and worker functions."""
from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


def assert_close(a: torch.Tensor, b: torch.Tensor, rel: float, what: str = "") -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    e = rel_err(a, b)
    assert e <= rel, f"{what}: relative error {e:.3e} > {rel:.0e}"


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()
