"""Weighted blending of datasets, in Megatron's ``--data-path 0.3 path_a 0.7 path_b`` form.

``data.paths: [0.3, data/a, 0.7, data/b]`` (or one entry ``"0.3 data/a 0.7 data/b"``; entries
are split at whitespace) trains on a blend in which 30% of the samples come from ``data/a`` and
70% from ``data/b``. Weights need not sum to 1 (they are normalised); paths without weights
are one dataset, their files back to back, as before.

Which dataset the i-th global sample comes from, and which of that dataset's samples it is,
is a pure function of i (and the weights and seed), computed in O(log datasets) per sample
with no table: the datasets form a balanced binary tree, and at each node the samples reaching
it are split between its two halves by a Bresenham line of slope w (the left half's share of
the node's weight): the t-th sample reaching the node goes left iff ``floor((t+1)w + 1/2) >
floor(tw + 1/2)``, and is then the ``floor(tw + 1/2)``-th sample of the left half (else the
``t - floor(tw + 1/2)``-th of the right). Every prefix of the sample sequence holds each
dataset's share to within one sample per tree level, and the map is a bijection whatever the
float rounding (the floor is monotone, with steps of 0 or 1). The k-th sample of dataset d is
then its item ``global_order(k)`` with that dataset's own seed and epochs (``sampling``), so a
small dataset repeats (reshuffled each epoch) while a large one is still in its first.

So the blend is deterministic, independent of the parallel layout (a rank computes only its
own global samples) and resumes mid-epoch from ``consumed_samples`` alone, like the single
dataset's order.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from torch.utils.data import Dataset

from megamoe.data.sampling import global_order
from megamoe.core.errors import ConfigError


def parse_blend(paths: Sequence, field: str = "data.paths") -> tuple[list[str], list[float] | None]:
    """Megatron's path list -> (paths, weights); weights None when no entry is a number."""
    words = [w for entry in paths for w in str(entry).split()]
    if not words:
        return [], None
    numbers = [_number(w) for w in words]
    if numbers[0] is None:
        bad = next((w for w, n in zip(words, numbers) if n is not None), None)
        if bad is not None:
            raise ConfigError(f"{field}={list(paths)!r} is invalid: {bad!r} looks like a weight, but the list does "
                              "not start with one (weighted form: [w1, path1, w2, path2, ...])")
        return words, None
    if len(words) % 2 or any(n is None for n in numbers[::2]) or any(n is not None for n in numbers[1::2]):
        raise ConfigError(f"{field}={list(paths)!r} is invalid: the weighted form alternates weights and paths "
                          "([w1, path1, w2, path2, ...])")
    weights = [float(n) for n in numbers[::2]]
    if any(not (math.isfinite(w) and w > 0) for w in weights):
        raise ConfigError(f"{field}={list(paths)!r} is invalid: every weight must be a finite number > 0")
    return words[1::2], weights


def _number(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def blend_assign(samples: np.ndarray, weights: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Global sample indices -> (dataset of each, its index among that dataset's samples)."""
    samples = np.asarray(samples, dtype=np.int64)
    which = np.zeros(samples.size, dtype=np.int64)
    position = samples.reshape(-1).copy()
    w = np.asarray(weights, dtype=np.float64)

    def descend(sel: np.ndarray, lo: int, hi: int) -> None:
        if hi - lo == 1 or sel.size == 0:
            which[sel] = lo
            return
        mid = (lo + hi) // 2
        share = w[lo:mid].sum() / w[lo:hi].sum()
        t = position[sel].astype(np.float64)
        before = np.floor(t * share + 0.5).astype(np.int64)
        left = np.floor((t + 1) * share + 0.5).astype(np.int64) > before
        position[sel] = np.where(left, before, position[sel] - before)
        descend(sel[left], lo, mid)
        descend(sel[~left], mid, hi)

    descend(np.arange(samples.size), 0, len(w))
    return which.reshape(samples.shape), position.reshape(samples.shape)


def component_seed(seed: int, d: int) -> int:
    """Dataset d's own sample-order seed (distinct per dataset, non-negative)."""
    return (seed * 1_000_003 + 7919 * (d + 1)) % (1 << 62)


class Blend(Dataset):
    """Datasets blended by weight. Items are numbered dataset after dataset (item ``offset[d] + i``
    is ``datasets[d][i]``); ``order(samples, seed, shuffle)`` maps global sample indices to them."""

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], names: Sequence[str] = ()):
        self.datasets, self.names = list(datasets), list(names) or [str(i) for i in range(len(datasets))]
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.sizes = [len(d) for d in self.datasets]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, item: int):
        d = int(np.searchsorted(self.offsets, item, side="right")) - 1
        return self.datasets[d][int(item - self.offsets[d])]

    def order(self, samples: np.ndarray, seed: int, shuffle: bool = True) -> np.ndarray:
        which, position = blend_assign(samples, self.weights)
        out = np.empty_like(position)
        for d in np.unique(which):
            sel = which == d
            out[sel] = self.offsets[d] + global_order(position[sel], self.sizes[d], component_seed(seed, int(d)), shuffle)
        return out

    def describe(self) -> str:
        return ", ".join(f"{w:.3g} {n} ({s} samples)" for w, n, s in zip(self.weights, self.names, self.sizes))

    def holdout(self, fraction: float, split) -> tuple["Blend", "Blend"]:
        """Each dataset split by ``split(dataset, fraction)``; both halves keep the weights."""
        parts = [split(d, fraction) for d in self.datasets]
        return (Blend([p[0] for p in parts], self.weights, self.names),
                Blend([p[1] for p in parts], self.weights, self.names))
