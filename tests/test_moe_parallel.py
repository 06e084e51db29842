"""Expert parallelism equals a single process: EP=2, ETP=2 (both dispatchers), EP=2 x TP=2 with
and without SP and EP=2 x ETP=2 (4 processes). Outputs, input and weight gradients, balancing
losses and expert loads, fp32, relative error <= 1e-5. Plus the expert-bias update on DP=2.

Every data-parallel replica routes its own batch; the single-process reference runs each
replica's batch, so gradients are compared after summing over data-parallel replicas (dense
parameters over dp, expert parameters over the expert-data-parallel group).
"""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import ModelConfig, MoEConfig, ParallelConfig
from tests.numerics import rel_err

REL = 1e-5
H, B, S = 16, 2, 8

# softmax scores, gated shared expert, all three losses
SOFTMAX = dict(num_experts=8, top_k=2, moe_ffn_hidden_size=8, num_shared_experts=1, shared_expert_ffn_hidden_size=16,
               shared_expert_gate=True, aux_loss_coeff=0.01, seq_aux_loss_coeff=0.02, z_loss_coeff=1e-3)
# sigmoid scores, group-limited, expert bias, scaling, ungated shared expert, capacity with drops
SIGMOID = dict(num_experts=8, top_k=2, moe_ffn_hidden_size=8, num_shared_experts=1, score_function="sigmoid",
               n_group=4, topk_group=2, expert_bias=True, routed_scaling_factor=2.5, aux_loss_coeff=0.01,
               z_loss_coeff=1e-3, capacity_factor=1.0)
CONFIGS = {"softmax": SOFTMAX, "sigmoid": SIGMOID, "sigmoid-dropless": dict(SIGMOID, capacity_factor=None)}


def build_moe(moe: dict, groups=None, sp: bool = False, seed: int = 0):
    from megamoe.layers.mlp.moe import MoELayer
    from megamoe.model.language_model import build_context
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.model.weights import initialize

    cfg = ModelConfig(hidden_size=H, layout="Ae", moe=MoEConfig(**moe))
    groups = groups or ParallelGroups()
    layer = MoELayer(cfg.moe, build_context(cfg, groups, sequence_parallel=sp), 0)
    initialize(layer, groups, seed)
    if layer.router.expert_bias is not None:  # a non-trivial bias, the same everywhere
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.randn(cfg.moe.num_experts, generator=torch.Generator().manual_seed(7)) * 0.05)
    return layer


def batches(n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)) for _ in range(n)]


def reduced_grad(p, groups):
    """This parameter's gradient summed the way a trainer would, then gathered to full size."""
    from megamoe.parallel.record import is_expert_param
    from megamoe.parallel import comm
    from megamoe.parallel.sharding import gather_full

    g = p.grad.clone()
    comm.all_reduce_tensor(g, groups.edp if is_expert_param(p) else groups.dp_cp)
    return gather_full(p, groups, g)


def parity_case(config: str, parallel: dict, sp: bool = False, dispatcher: str = "alltoall",
                extra: dict | None = None) -> dict:
    """``extra``: MoE settings of the parallel model only (redundant experts: tests/test_replicas.py)."""
    from megamoe.model.moe_controls import moe_metrics
    from megamoe.parallel.groups import build_groups
    from megamoe.model.weights import finalize_grads

    moe = dict(CONFIGS[config], dispatcher=dispatcher)
    groups = build_groups(ParallelConfig(**parallel, sequence_parallel=sp))
    data = batches(groups.size("dp"))
    ref, model = build_moe(moe), build_moe(dict(moe, **(extra or {})), groups, sp)
    ref_x = [x.clone().requires_grad_(True) for x, _ in data]
    ref_y = [ref(x) for x in ref_x]
    sum((y * g).sum() for y, (_, g) in zip(ref_y, data)).backward()

    x, g = data[groups.rank("dp")]
    ref_i = groups.rank("dp")
    shard = slice(None)
    if sp:
        n = S // groups.tp_size
        shard = slice(groups.tp_rank * n, (groups.tp_rank + 1) * n)
    x_local = x[:, shard].clone().requires_grad_(True)
    y = model(x_local)
    (y * g[:, shard]).sum().backward()
    finalize_grads(model, groups)

    errs = {"out": rel_err(y, ref_y[ref_i][:, shard]), "grad x": rel_err(x_local.grad, ref_x[ref_i].grad[:, shard])}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            errs[f"grad {name}"] = rel_err(reduced_grad(p, groups), ref_params[name].grad)
    mine, theirs = moe_metrics(model, groups)[0], moe_metrics(ref)[0]
    for key in ("aux_loss", "seq_aux_loss", "z_loss", "tokens_per_expert", "dropped_tokens", "router_entropy"):
        if key in theirs:
            errs[key] = rel_err(torch.tensor(mine[key]), torch.tensor(theirs[key]))
    errs["_dropped"] = theirs["dropped_tokens"]
    if model.replicas is not None:  # this rank's pairs that went to a replica slot
        with torch.no_grad():
            slots = model.replicas.route(model.router(x_local.reshape(-1, H), B).idx)
        per = model.replicas.num_slots // groups.size("ep")
        errs["_replica_pairs"] = int((slots % per >= per - len(model.replicas.arrival)).sum())
    if groups.tp_size > 1 and not sp:  # decoding-like: a sequence that does not split over TP
        model.eval(), ref.eval()
        with torch.no_grad():
            errs["eval odd sequence"] = rel_err(model(x[:, :3]), ref(x[:, :3]))
    return errs


def check(results: list[dict], expect_drops: bool = False) -> None:
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not k.startswith("_") and v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"
        assert "grad router.weight" in errs and "grad experts.down_weight" in errs
        assert "aux_loss" in errs and "z_loss" in errs
        if expect_drops:
            assert errs["_dropped"] > 0, "the capacity case should drop some tokens"


@pytest.mark.parametrize("case", [
    ("softmax", dict(ep=2), "alltoall"),
    ("sigmoid", dict(ep=2), "allgather"),
    ("sigmoid", dict(etp=2), "alltoall"),
    ("softmax", dict(etp=2), "allgather"),
], ids=["ep2-alltoall", "ep2-allgather-capacity", "etp2-alltoall-capacity", "etp2-allgather"])
def test_expert_parallel_two_ranks(pool, case):
    config, parallel, dispatcher = case
    check(pool(2).run(parity_case, config, parallel, False, dispatcher), expect_drops=config == "sigmoid")


@pytest.mark.parametrize("case", [
    ("softmax", dict(tp=2, ep=2), True),
    ("sigmoid-dropless", dict(tp=2, ep=2), False),
    ("softmax", dict(ep=2, etp=2), False),
], ids=["tp2-sp-ep2", "tp2-ep2", "ep2-etp2"])
def test_expert_parallel_four_ranks(pool, case):
    config, parallel, sp = case
    check(pool(4).run(parity_case, config, parallel, sp))


def bias_update_case(steps: int = 2) -> dict:
    """DP=2 (each rank its own batches), 2 micro-batches per step, then update_expert_bias."""
    from megamoe.layers.mlp.router import select_experts
    from megamoe.model.moe_controls import update_expert_bias
    from megamoe.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(ep=2))
    moe = dict(SIGMOID, capacity_factor=None, expert_bias_update_rate=0.1)
    model = build_moe(moe, groups)
    start = model.router.expert_bias.detach().clone()
    data = batches(2 * steps, seed=3)  # micro-batch mb of rank r: data[2 * mb + r]
    counts = torch.zeros(moe["num_experts"])
    for mb in range(steps):  # micro-batches of this step
        for r in range(2):  # the load the update must see: both ranks' micro-batches
            x = data[2 * mb + r][0]
            with torch.no_grad():
                scores = model.router.logits(x.reshape(-1, H)).sigmoid()
            _, idx = select_experts(scores, model.router.cfg, start)
            counts += torch.bincount(idx.reshape(-1), minlength=moe["num_experts"]).float()
        x = data[2 * mb + groups.rank("dp")][0]
        model(x).sum().backward()
    loads = update_expert_bias(model, groups)
    delta = model.router.expert_bias.detach() - start
    return {"delta": delta.tolist(), "load": loads[0].tolist(), "expected_load": counts.tolist()}


def test_expert_bias_update_identical_on_dp_ranks(pool):
    r0, r1 = pool(2).run(bias_update_case)
    assert r0["delta"] == r1["delta"], "bias differs between data-parallel ranks"
    assert r0["load"] == r0["expected_load"], "the update must use the load of every rank's micro-batches"
    load = torch.tensor(r0["load"])
    delta = torch.tensor(r0["delta"])
    over, under = load > load.mean(), load < load.mean()
    assert over.any() and under.any()
    assert torch.allclose(delta[over], torch.tensor(-0.1)) and torch.allclose(delta[under], torch.tensor(0.1))
