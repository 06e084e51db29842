"""DeepSeek-V4 parallel == single (gloo): the W, C, H mixers at TP=2 (with and without SP), CP=2 and
CP=4 (blocks straddling chunk borders, the halo and the short-sequence all-gather, packed documents
across borders, CP=2 x TP=2 with SP), a CP prefill then decoding without CP; the whole model at
TP=2 with SP, EP=2 and ETP=2 (every gradient, reduced as a trainer reduces it), and PP=2
training (hash routing on the second stage) equal to DP=2. fp32, relative error <= 1e-5 (for the
whole model: or 3x a gradient's fp32 noise floor, its error in one process against float64, where
that is larger: the mHC head's bias and scales are sums over every token that nearly cancel)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.core.config import ParallelConfig
from megamoe.parallel.context import position_in_document
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import build_mixer, param_grad_errors
from tests.numerics import rel_err
from tests.v4_utils import randomize_v4, tiny_v4

REL = 1e-5


def reference_mixer(letter: str, seed: int = 0):
    cfg = tiny_v4()
    ref = build_mixer(letter, cfg, seed=seed)
    randomize_v4(ref, seed)
    return cfg, ref, {name: p.detach().clone() for name, p in ref.named_parameters()}


def packed(seq: int) -> torch.Tensor:
    """[2, seq] documents crossing chunk borders (and one shorter than a block)."""
    a, b = seq // 3 + 1, 3
    row0 = torch.cat([torch.full((a,), 0), torch.full((b,), 1), torch.full((seq - a - b,), 2)])
    return torch.stack([row0, torch.cat([torch.full((seq - 13,), 0), torch.full((13,), 1)])])


def check(results, rel: float = REL) -> None:
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > rel}
        assert not bad, f"rank {rank}: relative errors over {rel}: {bad}"
        assert any("grad linear_q" in k for k in errs)


# ---- mixers ------------------------------------------------------------------------------------

def mixer_case(letter: str, tp: int = 1, cp: int = 1, sp: bool = False, seq: int = 40, docs: bool = False) -> dict:
    """This rank's errors against one process: outputs, input gradients, every parameter gradient
    (summed over CP)."""
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups
    from megamoe.model.weights import finalize_grads

    groups = build_groups(ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp))
    cfg, ref, state = reference_mixer(letter)
    par = build_mixer(letter, cfg, groups, sp=sp, full_state=state)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(2, seq, 32, generator=gen), torch.randn(2, seq, 32, generator=gen)
    documents = packed(seq) if docs else None
    pos = position_in_document(documents) if docs else torch.arange(seq).expand(2, -1)
    shard = ContextShard(groups.cp, seq)
    local = lambda t: shard.split(t).chunk(tp, dim=1)[groups.tp_rank] if sp else shard.split(t)  # noqa: E731
    xr, xp = x.clone().requires_grad_(True), local(x).clone().requires_grad_(True)
    yr = ref(xr, ForwardInfo(positions=pos, documents=documents))
    yp = par(xp, ForwardInfo(positions=shard.split(pos), cp=shard if cp > 1 else None, documents=documents))
    (yr * g).sum().backward()
    (yp * local(g)).sum().backward()
    finalize_grads(par, groups)
    errs = {"out": rel_err(yp, local(yr)), "grad x": rel_err(xp.grad, local(xr.grad))}
    return param_grad_errors(ref, par, groups, errs, cp_group=groups.cp if cp > 1 else None)


def letters_case(**kw) -> dict:
    """``mixer_case`` for W, C and H in one task (one pool round trip)."""
    return {f"{letter} {k}": v for letter in "WCH" for k, v in mixer_case(letter, **kw).items()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_mixers_tp2_equal_tp1(pool, sp):
    check(pool(2).run(letters_case, tp=2, sp=sp))


@pytest.mark.parametrize("docs", [False, True], ids=["plain", "packed"])
def test_mixers_cp2_equal_one_process(pool, docs):
    """40 tokens, chunks of 10: CSA and HCA blocks straddle the chunk borders (halo path)."""
    check(pool(2).run(letters_case, cp=2, docs=docs))


@pytest.mark.parametrize("seq", [72, 40], ids=["halo", "short-all-gather"])
def test_mixers_cp4_equal_one_process(pool, seq):
    """Chunks of 9 (blocks straddle, the rows before a chunk fit in it) and of 5 (the rows a chunk
    needs reach two chunks back: all-gathered instead)."""
    check(pool(4).run(letters_case, cp=4, seq=seq, docs=seq == 72))


def test_mixers_cp2_tp2_sp_equal_one_process(pool):
    check(pool(4).run(letters_case, cp=2, tp=2, sp=True))


def prefill_case(letter: str) -> dict:
    """A CP=2 prefill of 40 tokens into a decode cache, then 6 decode steps without CP on every
    rank, against one process decoding the same way."""
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.parallel.context import ContextShard
    from megamoe.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(cp=2))
    cfg, ref, state = reference_mixer(letter)
    par = build_mixer(letter, cfg, groups, full_state=state)
    x = torch.randn(2, 46, 32, generator=torch.Generator().manual_seed(2))
    shard = ContextShard(groups.cp, 40)
    outs = {}
    with torch.no_grad():
        for name, mixer, cp in (("ref", ref, None), ("cp", par, shard)):
            cache = InferenceCache(2)
            pos = cache.positions(40)
            first = mixer(x[:, :40] if cp is None else cp.split(x[:, :40]),
                          ForwardInfo(positions=pos if cp is None else cp.split(pos), cache=cache, cp=cp))
            cache.advance(40)
            steps = []
            for t in range(40, 46):
                steps.append(mixer(x[:, t:t + 1], ForwardInfo(positions=cache.positions(1), cache=cache)))
                cache.advance(1)
            outs[name] = (first, torch.cat(steps, dim=1))
    return {"prefill": rel_err(outs["cp"][0], shard.split(outs["ref"][0])),
            "decode": rel_err(outs["cp"][1], outs["ref"][1])}


def test_cp2_prefill_then_decoding_equal_one_process(pool):
    for letter in "WCH":
        for rank, errs in enumerate(pool(2).run(prefill_case, letter)):
            assert max(errs.values()) <= REL, (letter, rank, errs)


# ---- the whole model ---------------------------------------------------------------------------

def model_case(parallel: dict, sp: bool = False) -> dict:
    """The model (``WhCeHe``: hash and top-k MoE, hyper-connections with the learned head) split by
    ``parallel`` against one process: the loss and every gradient, summed as a trainer sums them
    (TP partial sums, then data-parallel ranks; experts over their own data-parallel group). Each
    data-parallel rank takes its own row of the batch."""
    from megamoe.model.build import build_model
    from megamoe.model.language_model import shift_labels
    from megamoe.parallel import comm
    from megamoe.parallel.groups import ParallelGroups, build_groups
    from megamoe.parallel.record import is_expert_param
    from megamoe.parallel.sharding import gather_full
    from megamoe.model.weights import finalize_grads, full_state_dict, initialize, load_full_state_dict
    from tests.test_tensor_parallel import fp32_noise_floor

    groups = build_groups(ParallelConfig(**parallel, sequence_parallel=sp))
    cfg = tiny_v4()
    ref = build_model(cfg)
    initialize(ref, ParallelGroups(), 0)
    randomize_v4(ref, 0)
    model = build_model(cfg, groups, sequence_parallel=sp)
    load_full_state_dict(model, full_state_dict(ref, ParallelGroups()), groups)
    dp = groups.size("dp")
    ids = torch.randint(3, 64, (dp, 24), generator=torch.Generator().manual_seed(3))
    labels = shift_labels(ids)
    ref_loss = ref(ids, labels=labels)  # the mean over every token of the batch
    ref_loss.backward()
    row = slice(groups.rank("dp"), groups.rank("dp") + 1)
    loss = model.loss_sum(model.forward_stage(ids[row]), labels[row]) / (labels >= 0).sum()
    loss.backward()
    finalize_grads(model, groups)
    errs = {"loss": rel_err(comm.all_reduce_tensor(loss.detach().clone(), groups.dp_cp), ref_loss)}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if want is None:
            errs[f"no grad {name}"] = 0.0 if p.grad is None else 1.0
            continue
        grad = p.grad.clone()
        comm.all_reduce_tensor(grad, groups.edp if is_expert_param(p) else groups.dp_cp)
        errs[f"grad {name}"] = rel_err(gather_full(p, groups, grad), want)
    errs.update(fp32_noise_floor(ref, ids, labels))
    return errs


@pytest.mark.parametrize("parallel", [dict(tp=2), dict(ep=2), dict(etp=2)], ids=["tp2-sp", "ep2", "etp2"])
def test_model_parallel_equals_one_process(pool, parallel):
    from tests.test_tensor_parallel import over_tolerance

    results = pool(2).run(model_case, parallel, sp="tp" in parallel)
    for rank, errs in enumerate(results):
        bad = over_tolerance(errs, REL)
        assert not bad, f"rank {rank}: relative errors over 1e-5 (or 3x the fp32 noise floor): {bad}"
        assert max(v for k, v in errs.items() if k.startswith("floor ")) < 1e-4  # the floor is rounding
        assert "grad layers.0.mlp.experts.gate_up_weight" in errs and "grad stream_head.fn" in errs


def test_pp2_training_equals_dp2(pool, tmp_path):
    """The second stage's hash-routed layer reads the token ids the pipeline hands every stage."""
    from tests.test_trainer_parity import check_pp2_equals_dp2, tiny_recipe

    recipe = tiny_recipe(ParallelConfig(), steps=3)
    recipe.model = tiny_v4("WhCe|HhWe")
    recipe.data = dataclasses.replace(recipe.data, seq_len=24)
    check_pp2_equals_dp2(pool, recipe, tmp_path)
