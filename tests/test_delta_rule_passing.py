"""The delta rule over the chunks of a split sequence with the states passed between them
(``megamoe.layers.ops.delta_rule.passing``, the roles' ``passing``), in one process: a context
shard of one rank holds both chunks of each row, so the ``StateLink``'s all-gathers are the
identity while its scans, the op's transition columns and the backward's exchange of the
state gradients run as under CP (tests/test_cp_linear.py runs them over gloo).

Against the naive recurrence over the whole sequence in float64: outputs and the gradients of
q, k, v, g and beta, fp32 relative error <= 1e-5, for the per-head op that passes states itself
(kept and recomputed, with decays of about -20 per token that make the transitions underflow)
and the widened form (per-channel decay; the local backend's recurrence); two value heads per
key head, dk != dv, chunks that are not whole numbers of the op's inner chunks. Under a decode
state (prefill) the chunks start from it and leave the state after the sequence.
"""
from __future__ import annotations

import pytest
import torch

from megamoe.layers.backends.cpu import ChunkedDeltaRule
from megamoe.layers.backends.local import RecurrentDeltaRule
from megamoe.layers.ops.delta_rule.naive import naive_delta_rule
from megamoe.layers.ops.fusion import EAGER
from megamoe.layers.ops.sequence_view import SequenceView
from megamoe.parallel.context import ContextShard
from tests.numerics import rel_err
from tests.test_delta_rule import make_inputs

REL = 1e-5
T = 74  # two chunks of 37 tokens: 2 inner chunks of 16 and a padded one


def inputs(per_channel: bool, decay_scale: float = 1.0):
    return make_inputs(T, per_channel, seed=3, hk=2, hv=4, dk=8, dv=6, decay_scale=decay_scale)


def with_grads(fn, xs):
    xs = [x.clone().requires_grad_(True) for x in xs]
    o = fn(*xs)
    (o * torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(o.dtype)).sum().backward()
    return [o] + [x.grad for x in xs]


def passed(role, recompute: bool = False):
    view = SequenceView(ContextShard(None, T), None)
    return lambda *x: view.delta_rule(role, *x, chunk_size=16, recompute=recompute)


def naive(*x):
    return naive_delta_rule(*x)[0]


CASES = {  # role, per-channel decay, recompute, decay scale
    "gdn": (ChunkedDeltaRule(EAGER), False, False, 1.0),
    "gdn-recompute": (ChunkedDeltaRule(EAGER), False, True, 1.0),
    "gdn-strong": (ChunkedDeltaRule(EAGER), False, False, 20.0),
    "kda-widened": (ChunkedDeltaRule(EAGER), True, False, 1.0),
    "gdn-local-widened": (RecurrentDeltaRule(), False, True, 1.0),
}


@pytest.mark.parametrize("case", CASES)
def test_passing_equals_one_pass(case):
    role, per_channel, recompute, scale = CASES[case]
    xs = inputs(per_channel, scale)[:5]
    got = with_grads(passed(role, recompute), xs)
    want = with_grads(naive, [x.double() for x in xs])
    errs = {name: rel_err(a, b) for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, want)}
    assert max(errs.values()) <= REL, errs
    assert got[0].dtype == torch.float32


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_prefill_starts_from_and_leaves_the_decode_state(per_channel):
    q, k, v, g, beta, h0 = inputs(per_channel)
    state = {"recurrent": h0.clone()}
    view = SequenceView(ContextShard(None, T), None, state)
    with torch.no_grad():
        o = view.delta_rule(ChunkedDeltaRule(EAGER), q, k, v, g, beta, chunk_size=16)
    want, final = naive_delta_rule(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double())
    assert rel_err(o, want) <= REL and rel_err(state["recurrent"], final) <= REL
