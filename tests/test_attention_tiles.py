"""Ring attention's tile kernels (megamoe.layers.ops.attention.tiles) and which tiles the ring runs.

The fused tiles (the cpu/cuda backends' FusedTiles: torch's CPU flash kernel with the
log-sum-exp, and its backward) equal the math
reference on whole and causal tiles (GQA, strided slices as the ring passes them), forward and
backward given the row's output and log-sum-exp, fp32 within 1e-5; a masked tile goes to the
math form. Ring attention's parity with one process is in tests/test_cp_softmax.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megamoe.layers.ops.attention.context import _Blocks
from megamoe.layers.backends.cpu import FUSED
from megamoe.layers.ops.attention.tiles import CPU_FLASH, MATH
from tests.numerics import rel_err

REL = 1e-5


def _tile(n: int = 37, m: int = 37, hq: int = 4, hk: int = 2, d: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, 3 * t, d, generator=gen)[:, :, t:2 * t] for h, t in ((hq, n), (hk, m), (hk, m)))
    return q, k, v, torch.randn(2, hq, n, d, generator=gen)


@pytest.mark.parametrize("causal, m", [(False, 53), (True, 37)], ids=["full", "causal"])
def test_fused_tiles_equal_math_tiles(causal, m):
    q, k, v, do = _tile(m=m)
    out, lse = MATH.forward(q, k, v, 0.3, causal)
    f_out, f_lse = FUSED.forward(q, k, v, 0.3, causal)
    assert rel_err(f_out, out) <= REL and rel_err(f_lse, lse) <= REL
    for name, a, b in zip("qkv", MATH.backward(do, q, k, v, out, lse, 0.3, causal),
                          FUSED.backward(do, q, k, v, out, lse, 0.3, causal)):
        assert a.shape == b.shape and rel_err(b, a) <= REL, name


def test_math_tiles_equal_autograd_softmax():
    """The reference itself: a masked tile's output and gradients against plain softmax autograd."""
    q, k, v, do = _tile(n=9, m=11)
    mask = torch.rand(2, 1, 9, 11, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
    s = (qa @ ka.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    ref = s.masked_fill(~mask, float("-inf")).softmax(-1) @ va.repeat_interleave(2, 1)
    ref.backward(do)
    out, lse = MATH.forward(q, k, v, 0.3, mask=mask)
    assert rel_err(out, ref) <= REL
    for got, want in zip(MATH.backward(do, q, k, v, out, lse, 0.3, mask=mask), (qa.grad, ka.grad, va.grad)):
        assert rel_err(got, want) <= REL
    assert CPU_FLASH.fuses(q, v, None) and not CPU_FLASH.fuses(q, v, mask)  # masked: the math form


def _kinds(window: int = 0, documents=None, n: int = 4096, tile: int = 1024):
    """(tile size, causal, masked) of every tile rank 0 of CP=2 runs over every source rank."""
    cp = SimpleNamespace(rank=0, size=2, chunk_len=n,
                         chunk_bounds=lambda r=0: [(c * n, (c + 1) * n) for c in ((0, 3), (1, 2))[r]])
    blocks = _Blocks(cp, window, documents, "cpu", tile)
    return [(qs.stop - qs.start, ks.stop - ks.start, causal, mask is not None)
            for src in (0, 1) for qs, ks, causal, mask in blocks.pairs(src)]


def test_ring_runs_whole_chunks_fused_and_bounded_math_tiles_only_under_a_mask():
    """Causal CP=2 at 16K tokens: rank 0 (chunks 0 and 3) runs two causal diagonals and three
    whole chunk pairs, all fused, no mask; a sliding window or a document border cuts only the
    pairs it crosses into tiles of at most 1024, and only the tiles it cuts are masked."""
    assert sorted(_kinds()) == [(4096, 4096, False, False)] * 3 + [(4096, 4096, True, False)] * 2
    windowed = _kinds(window=1500)
    assert all(m <= 1024 and n <= 1024 for m, n, _, masked in windowed if masked)
    assert any(masked for *_, masked in windowed) and any(c for _, _, c, _ in windowed)
    docs = torch.zeros(1, 4 * 4096, dtype=torch.long)
    docs[:, 10000:] = 1  # a border inside chunk 2 (a key chunk of rank 1's block)
    packed = _kinds(documents=docs)
    assert sum(masked for *_, masked in packed) == 4  # (chunk 3 x chunk 2): 4 key tiles cross 10000
    assert all(m <= 1024 and n <= 1024 for m, n, _, masked in packed if masked)
    assert (4096, 4096, True, False) in packed  # chunk 0's diagonal: one document, fused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal, m", [(False, 53), (True, 37)], ids=["full", "causal"])
def test_fused_tiles_on_cuda_equal_math_tiles(causal, m):
    """CUDA bf16: the flash kernel's tile (K/V expanded per query head, gradients folded back)
    against the fp32 math reference on the same bf16 inputs, within bf16's resolution."""
    q, k, v, do = (t.cuda().bfloat16() for t in _tile(m=m, d=64))
    out, lse = MATH.forward(q, k, v, 0.125, causal)
    f_out, f_lse = FUSED.forward(q, k, v, 0.125, causal)
    assert rel_err(f_out, out) <= 1e-2 and rel_err(f_lse, lse) <= 1e-2
    for name, a, b in zip("qkv", MATH.backward(do, q, k, v, out, lse, 0.125, causal),
                          FUSED.backward(do, q, k, v, out, lse, 0.125, causal)):
        assert a.shape == b.shape and rel_err(b, a) <= 2e-2, name
