"""Every mixer under context parallelism at thousands of tokens, against one process.

The per-family files test CP at 24-72 tokens, where every chunk is a few tiles; here each mixer
runs 4096 tokens (CP=2: chunks of 1024, ring attention's whole-chunk fused tiles, MLA's and
DSA's query tiles of hundreds of rows, linear attention over 128 of its own chunks per CP chunk)
at the test sizes (hidden 32), outputs, input gradients and every parameter gradient within
1e-5 relative. CP=4 runs the default hybrid's two letters (G and A). One pool round trip per
family keeps the processes few.
"""
from __future__ import annotations

import pytest

from tests.test_block_sparse import model as block_sparse_model
from tests.test_compressed_parallel import check as check_compressed, letters_case as compressed_case
from tests.test_cp_linear import _check as check_linear, cp_case as linear_case
from tests.test_cp_softmax import check as check_softmax, cp_case as softmax_case

LONG = 4096


def softmax_family(cp: int, seq: int, letters: str = "ASMDI") -> dict:
    """Errors of every softmax-family mixer on this rank; A also over packed documents (tiles a
    document border cuts run masked, the others fused), S also with a window of 1500 (past a
    chunk: the ring with window-masked tiles; the default 7 is the halo exchange)."""
    runs = {letter: dict() for letter in letters}
    if "A" in letters:
        runs["A packed"] = dict(docs=True)
    if "S" in letters:
        runs["S window 1500"] = dict(window=1500)
    if "B" in letters:
        runs["B"] = dict(model={"attention": block_sparse_model().attention, "layout": "BdAd"})
    errs = {}
    for name, kw in runs.items():
        errs.update({f"{k} ({name})": v for k, v in softmax_case(name[0], cp, seq=seq, **kw).items()})
    return errs


def linear_family(cp: int, seq: int, letters: str = "GKL") -> dict:
    errs = {}
    for letter in letters:
        errs.update({f"{k} ({letter})": v for k, v in linear_case(letter, cp, 1, seq, False).items()})
    return errs


def test_softmax_mixers_cp2_at_4k_tokens(pool):
    check_softmax(pool(2).run(softmax_family, 2, LONG, "ASBMDI"), f"A S B M D I cp=2 at {LONG} tokens")


def test_linear_mixers_cp2_at_4k_tokens(pool):
    check_linear(pool(2).run(linear_family, 2, LONG), f"G K L cp=2 at {LONG} tokens")


def test_compressed_mixers_cp2_at_4k_tokens(pool):
    check_compressed(pool(2).run(compressed_case, cp=2, seq=LONG))


@pytest.mark.parametrize("family, letter, check", [(linear_family, "G", check_linear),
                                                   (softmax_family, "A", check_softmax)], ids=["G", "A"])
def test_default_hybrid_letters_cp4_at_4k_tokens(pool, family, letter, check):
    check(pool(4).run(family, 4, LONG, letter), f"{letter} cp=4 at {LONG} tokens")
