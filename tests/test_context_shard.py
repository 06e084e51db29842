"""ContextShard: the load-balanced 2·CP chunk split and its autograd all-gather, over real gloo ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megamoe.core.errors import ConfigError
from megamoe.parallel.context import ContextShard, check_cp_length


def test_single_rank_is_identity():
    cp = ContextShard(None, 10)
    x = torch.randn(2, 10, 3)
    assert cp.split(x) is x and cp.gather(x) is x
    assert torch.equal(cp.local_index(), torch.arange(10))


def test_length_not_divisible_is_one_line():
    with pytest.raises(ConfigError, match=r"sequence length 30 is not divisible by 2\*parallel.cp = 8"):
        check_cp_length(30, 4)


def _roundtrip(seq_len: int):
    group = dist.group.WORLD
    cp = ContextShard(group, seq_len)
    torch.manual_seed(0)
    full = torch.randn(2, seq_len, 3, dtype=torch.float64)
    weights = torch.randn(2, seq_len, 3, dtype=torch.float64)
    local = cp.split(full).requires_grad_()
    assert torch.equal(local[0, :, 0], full[0, cp.local_index(), 0])
    # every rank uses the gathered sequence with its own weights: the gradient of a local token is
    # the sum over ranks of (rank + 1) * weights
    gathered = cp.gather(local)
    assert torch.equal(gathered, full)
    (gathered * weights * (cp.rank + 1)).sum().backward()
    scale = sum(r + 1 for r in range(cp.size))
    torch.testing.assert_close(local.grad, cp.split(weights) * scale, rtol=0, atol=1e-12)
    return cp.chunk_ids()


@pytest.mark.parametrize("world", [2, 4])
def test_split_gather_roundtrip(pool, world):
    ids = pool(world).run(_roundtrip, 8 * world)
    assert ids == [(r, 2 * world - 1 - r) for r in range(world)]
