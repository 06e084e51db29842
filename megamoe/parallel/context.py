"""Context parallelism (CP): how the ranks of one CP group share a sequence.

A sequence of S tokens is cut into 2·CP equal chunks; rank r holds chunks r and 2·CP-1-r (one
from the front, one from the back), so under a causal mask every rank does the same work.
Every tensor a rank sees between the embedding and the loss covers only its two chunks, in
that order ("local order")::

    S = 16, CP = 2: chunks c0..c3 of 4 tokens
    rank 0 holds [c0 | c3] = tokens 0-3, 12-15      rank 1 holds [c1 | c2] = tokens 4-11

``positions`` (RoPE) are the local tokens' global positions, so rotary embeddings need no change.
Mixers that look across the sequence (softmax attention, the linear-attention state, the short
convolution) use ``ContextShard``: ``gather`` rebuilds the full sequence in global order with an
autograd-correct all-gather (its backward reduce-scatters, so each rank gets the gradient of its
own tokens summed over every rank that used them); ``chunk_bounds`` says where the local chunks sit.

Packed documents: ``documents`` [b, S] (global order, every rank holds all of it) numbers the
documents of a packed sequence (non-decreasing); a mixer must not let one document see another.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megamoe.core.errors import ConfigError
from megamoe.parallel.comm import gather_reduce_scatter
from megamoe.parallel.groups import group_rank, group_size


def check_cp_length(seq_len: int, cp: int, what: str = "sequence length") -> None:
    """One line naming the length and the CP size when the length cannot be cut in 2·CP chunks."""
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(f"{what} {seq_len} is not divisible by 2*parallel.cp = {2 * cp} "
                          f"(context parallelism cuts each sequence into 2*cp equal chunks)")


@dataclass(frozen=True)
class ContextShard:
    """This rank's share of a sequence of ``seq_len`` tokens under the CP group ``group``
    (``None``: a group of one; every method is then the identity)."""

    group: object
    seq_len: int

    def __post_init__(self):
        check_cp_length(self.seq_len, self.size)

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.size)

    @property
    def local_len(self) -> int:
        return 2 * self.chunk_len if self.size > 1 else self.seq_len

    def chunk_ids(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunk numbers (0 .. 2·CP-1) that ``rank`` (default: this rank) holds, front first."""
        return _chunk_ids(self.size, self.rank if rank is None else rank)

    def gathered_slot(self, chunk: int) -> int:
        """Where global chunk ``chunk`` sits in a rank-major all-gather of every rank's
        [front | back] chunks (the inverse of ``chunk_ids``)."""
        return 2 * chunk if chunk < self.size else 2 * (2 * self.size - 1 - chunk) + 1

    def chunk_bounds(self, rank: int | None = None) -> list[tuple[int, int]]:
        """[(start, end), (start, end)]: global token ranges of the local chunks, in local order."""
        n = self.chunk_len
        return [(c * n, (c + 1) * n) for c in self.chunk_ids(rank)]

    def local_index(self, device=None) -> torch.Tensor:
        """[local_len] long: the global position of each local token."""
        return _local_index(self.size, self.rank, self.seq_len, _device(device))

    def gather_order(self, device=None) -> torch.Tensor:
        """[seq_len] long: for each global position, its index in the rank-major all-gather."""
        return _gather_order(self.size, self.seq_len, _device(device))

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Full-sequence tensor (global order along ``dim``) -> this rank's two chunks (local order).
        Plain indexing: the gradient flows back to the full tensor's local slots only."""
        if self.size == 1:
            return x
        if x.size(dim) != self.seq_len:
            raise ValueError(f"ContextShard.split: dim {dim} has {x.size(dim)} entries, expected {self.seq_len}")
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.chunk_bounds()], dim=dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Local tensor (local order along ``dim``) -> the full sequence in global order, on every rank.
        Backward: reduce-scatter (each rank gets its tokens' gradient summed over all ranks)."""
        if self.size == 1:
            return x
        if x.size(dim) != self.local_len:
            raise ValueError(f"ContextShard.gather: dim {dim} has {x.size(dim)} entries, expected {self.local_len}")
        full = gather_reduce_scatter(x, dim, self.group)  # rank-major: [r0 front | r0 back | r1 front | ...]
        return full.index_select(dim, self.gather_order(x.device))


def _chunk_ids(size: int, rank: int) -> tuple[int, int]:
    """The layout in one place: rank r holds chunks r and 2·CP-1-r of the 2·CP."""
    return rank, 2 * size - 1 - rank


def _device(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


# Every gather of every layer asks for the same index tensors: built once per layout and device
# (no per-call host loop or host-to-device copy on the training step's path). They are tiny, and
# shared by every caller: read them (index_select, comparisons), never write into them.
@functools.lru_cache(maxsize=64)
def _local_index(size: int, rank: int, seq_len: int, device: torch.device) -> torch.Tensor:
    if size == 1:
        return torch.arange(seq_len, device=device)
    n = seq_len // (2 * size)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in _chunk_ids(size, rank)])


@functools.lru_cache(maxsize=64)
def _gather_order(size: int, seq_len: int, device: torch.device) -> torch.Tensor:
    n, order = seq_len // (2 * size), torch.empty(seq_len, dtype=torch.long)
    for r in range(size):
        for j, c in enumerate(_chunk_ids(size, r)):
            start = r * 2 * n + j * n
            order[c * n:(c + 1) * n] = torch.arange(start, start + n)
    return order.to(device)


def split_for_cp(cp: ContextShard | None, *tensors: torch.Tensor, dim: int = 1):
    """Each full-sequence tensor (or None) cut to this rank's chunks; identity without CP."""
    out = tuple(t if t is None or cp is None else cp.split(t, dim) for t in tensors)
    return out[0] if len(out) == 1 else out


def position_in_document(documents: torch.Tensor) -> torch.Tensor:
    """documents [b, T] (non-decreasing ids) -> [b, T] each token's position within its document."""
    idx = torch.arange(documents.size(1), device=documents.device).expand_as(documents)
    start = torch.ones_like(documents, dtype=torch.bool)
    start[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return idx - torch.cummax(torch.where(start, idx, 0), dim=1).values
