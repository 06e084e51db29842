"""Counter-based random numbers for shard-local initialisation.

Element ``i`` (flat index in the full, unsharded tensor) of parameter ``name`` under ``seed``
gets the value of a hash of (seed, name, i): a rank computes the values of its own shard
only, and they are the values the same positions have in every other layout. No rank ever
holds more than its shard plus one block of scratch (``BLOCK`` elements).

The hash is splitmix64's finaliser over ``key + i * golden`` (a counter-based generator in
the sense of Salmon et al. 2011: each output depends on the counter alone), evaluated with
int64 tensor ops; uniforms take its top 24 bits, normals go through the inverse normal CDF
(one uniform per element, so every element is a pure function of its position).
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import torch

# elements per block of scratch while a shard is drawn: the int64 scratch of 64K elements
# stays in cache (6 ns per normal on one core; 2.5x that with 4M-element blocks)
BLOCK = 1 << 16


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch wraps on overflow)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask the sign copies off)."""
    return torch.bitwise_right_shift(z, k, out=out).bitwise_and_((1 << (64 - k)) - 1)


def key_of(seed: int, name: str) -> int:
    """64-bit key of (seed, tensor name): the stream a tensor's values come from."""
    return _i64(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little"))


def hash64(key: int, index: torch.Tensor) -> torch.Tensor:
    """splitmix64(key + index * golden) for int64 ``index`` -> int64 of the same shape."""
    z = (index * _GOLDEN).add_(key)
    tmp = torch.empty_like(z)   # in place throughout: the block stays in cache
    z.bitwise_xor_(_shr(z, 30, tmp)).mul_(_M1)
    z.bitwise_xor_(_shr(z, 27, tmp)).mul_(_M2)
    return z.bitwise_xor_(_shr(z, 31, tmp))


class Draw:
    """The random source of one block of a shard: ``shape`` and the values at its positions.

    ``index`` [*shape] int64 holds each element's flat index in the full tensor."""

    def __init__(self, key: int, index: torch.Tensor):
        self.key, self.index, self.shape = key, index, tuple(index.shape)

    def uniform(self) -> torch.Tensor:
        """U(0, 1), open at both ends, float32."""
        bits = _shr(hash64(self.key, self.index), 40)            # top 24 bits
        # the top value, 1 - 2^-25, is not a float32 and would round to 1: clamp it to the float
        # below 1 (no other value changes)
        return bits.to(torch.float32).add_(0.5).mul_(2.0 ** -24).clamp_(max=1 - 2.0 ** -24)

    def normal(self) -> torch.Tensor:
        """N(0, 1) float32 by the inverse CDF of ``uniform`` (tails end near 5.3 sigma)."""
        # the top uniform, 1 - 2^-25, becomes 2 - 2^-24 -> rounds to 2.0 in float32, and 2u - 1 = 1
        # would give erfinv(1) = inf; clamping to the float below 1 changes no other value
        return torch.special.erfinv(self.uniform().mul_(2).sub_(1).clamp_(max=1 - 2.0 ** -24)).mul_(math.sqrt(2.0))


InitFn = Callable[[Draw], torch.Tensor]


def flat_index(positions: Sequence[torch.Tensor], full_shape: Sequence[int]) -> torch.Tensor:
    """Flat indices in a tensor of ``full_shape`` of the outer product of per-dim positions
    ([n_d] each) -> [n_0, n_1, ...] int64."""
    out = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(full_shape))):
        view = [1] * len(full_shape)
        view[d] = -1
        out = out + positions[d].view(view) * stride
        stride *= full_shape[d]
    return out


def draw_blocks(key: int, positions: Sequence[torch.Tensor], full_shape: Sequence[int]):
    """(slice along dim 0, Draw, padding mask | None) per block of about ``BLOCK`` elements.

    ``positions[d]`` [local size of dim d] are the full-tensor positions of this shard's
    entries along d; -1 marks padding (zero-filled, not drawn)."""
    if not full_shape:                                           # a scalar
        yield ..., Draw(key, torch.zeros((), dtype=torch.int64)), None
        return
    inner = math.prod(p.numel() for p in positions[1:])
    rows = max(1, BLOCK // max(inner, 1))
    for start in range(0, positions[0].numel(), rows):
        blk = [positions[0][start:start + rows], *positions[1:]]
        pad = None
        if any(bool((p < 0).any()) for p in blk):
            pad = _outer_any([p < 0 for p in blk])
            blk = [p.clamp_min(0) for p in blk]
        yield slice(start, start + rows), Draw(key, flat_index(blk, full_shape)), pad


def _outer_any(flags: Sequence[torch.Tensor]) -> torch.Tensor:
    """[n_0, n_1, ...] bool: True where any dim's flag [n_d] is set."""
    out = torch.zeros((), dtype=torch.bool)
    for d, f in enumerate(flags):
        view = [1] * len(flags)
        view[d] = -1
        out = out | f.view(view)
    return out
