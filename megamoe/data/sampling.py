"""The global sample order and each data-parallel rank's share of it.

Global order: the i-th sample the run consumes (i = 0, 1, 2, ...) is dataset item
``permute(i mod N, epoch = i // N)``, a seeded bijection of ``[0, N)`` that changes every epoch
(identity when ``shuffle`` is off). It depends only on (seed, N, i): not on the number of ranks,
workers or micro-batches.

Step k consumes global samples ``[c, c + G)`` with ``c = consumed_samples = k * G`` (G = global
batch size). Data-parallel rank r of D takes the contiguous slice ``[c + r*G/D, c + (r+1)*G/D)``
and splits it into micro-batches of ``micro_batch_size``. Resuming from a saved
``consumed_samples`` continues exactly, also with another D (same G).

The permutation is a Feistel network on the smallest power of four >= N with cycle walking,
so it needs O(1) memory for any N (a trillion-token corpus has hundreds of millions of windows).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megamoe.core.errors import ConfigError

_MASK64 = (1 << 64) - 1
ROUNDS = 6


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixing uint64 -> uint64 hash (elementwise, wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    keys = []
    for r in range(ROUNDS):
        mixed = (seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + r * 0xA24BAED4963EE407) & _MASK64
        keys.append(_splitmix(np.array([mixed], dtype=np.uint64))[0])
    return keys


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """A seeded bijection of ``[0, n)`` applied to ``positions`` (int array, values < n)."""
    positions = np.asarray(positions, dtype=np.int64)
    if n <= 1:
        return positions.copy()
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4**half >= n: cycle walking needs < 4 tries on average
    mask = np.uint64((1 << half) - 1)
    keys = _round_keys(seed, epoch)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for key in keys:
            left, right = right, left ^ (_splitmix(right ^ key) & mask)
        return (left << np.uint64(half)) | right

    out = feistel(positions.astype(np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():  # walk the cycle until it comes back inside [0, n): still a bijection
        out[outside] = feistel(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


def global_order(samples: np.ndarray, num_items: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Dataset item of each global sample index (``samples`` may run past one epoch)."""
    samples = np.asarray(samples, dtype=np.int64)
    if num_items <= 0:
        raise ConfigError(f"dataset has {num_items} samples; nothing to train on")
    position, epoch = samples % num_items, samples // num_items
    if not shuffle:
        return position
    out = np.empty_like(position)
    for e in np.unique(epoch):  # a global batch spans at most two epochs unless N < G
        sel = epoch == e
        out[sel] = permute(position[sel], num_items, seed, int(e))
    return out


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch of G samples is split: D data-parallel ranks, micro-batches of m."""

    global_batch_size: int
    micro_batch_size: int
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self):
        g, m, d, r = self.global_batch_size, self.micro_batch_size, self.dp_size, self.dp_rank
        if min(g, m, d) <= 0 or not 0 <= r < d:
            raise ConfigError(f"batch layout G={g}, micro={m}, dp_size={d}, dp_rank={r} is invalid: "
                              "sizes must be positive and 0 <= dp_rank < dp_size")
        if g % (m * d) != 0:
            raise ConfigError(f"global_batch_size={g} is invalid: must be a multiple of "
                              f"micro_batch_size*dp_size={m}*{d}={m * d}")

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def num_micro_batches(self) -> int:
        return self.per_rank // self.micro_batch_size

    def rank_samples(self, consumed_samples: int) -> np.ndarray:
        """Global sample indices this rank takes in the step that starts at ``consumed_samples``."""
        start = consumed_samples + self.dp_rank * self.per_rank
        return np.arange(start, start + self.per_rank, dtype=np.int64)

    def micro_batches(self, consumed_samples: int) -> list[np.ndarray]:
        """The rank's global sample indices for one step, split into micro-batches, in order."""
        return np.split(self.rank_samples(consumed_samples), self.num_micro_batches)
