"""Decode cache shared by every mixer.

One ``InferenceCache`` per generation; each mixer keeps its own state in the dict that
``cache.layer(layer_number)`` returns: softmax/MLA/DSA keep keys and values (or their
compressed latents), linear mixers keep their conv window and recurrent state. The model
advances ``seen`` after every forward, so positions are ``seen + arange(new tokens)``.

States stay on the mixer's TP shard (its heads), so a TP model decodes without gathers.
"""
from __future__ import annotations

import torch


class InferenceCache:
    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.seen = 0  # tokens already processed per sample
        self._layers: dict[int, dict] = {}

    def layer(self, layer_number: int) -> dict:
        return self._layers.setdefault(layer_number, {})

    def advance(self, n: int) -> None:
        self.seen += n

    def positions(self, n: int, device=None) -> torch.Tensor:
        """[b, n] positions of the next n tokens."""
        pos = torch.arange(self.seen, self.seen + n, device=device)
        return pos.unsqueeze(0).expand(self.batch_size, -1)

    def reorder(self, index: torch.Tensor) -> None:
        """Select/reorder samples (beam search, dropping finished rows) in every state."""
        for state in self._layers.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.index_select(0, index)
        self.batch_size = int(index.numel())


def append_kv(state: dict, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append new keys/values [b, t, h, d] along time; return all of them."""
    if "k" in state:
        k = torch.cat([state["k"], k], dim=1)
        v = torch.cat([state["v"], v], dim=1)
    state["k"], state["v"] = k, v
    return k, v


def append_time(state: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    """Append ``x`` [b, t, ...] to ``state[name]`` along time (dim 1); return everything so far."""
    if name in state:
        x = torch.cat([state[name], x], dim=1)
    state[name] = x
    return x


def trim_kv(state: dict, keep: int) -> None:
    """Keep only the last ``keep`` cached keys/values (sliding-window layers)."""
    n = state["k"].size(1)
    if n > keep:
        state["k"], state["v"] = state["k"][:, n - keep:], state["v"][:, n - keep:]
