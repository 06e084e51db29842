"""Redundant hot experts (``model.moe.redundant_experts``, layers/mlp/replicas.py): copies of hot
experts in extra slots on other EP ranks change no output or gradient (one process, gloo EP=2,
EP=4 and EP=2 x ETP=2 against one unreplicated process), stay equal to the unreplicated expert
through training, even the busiest EP rank of a skewed router, keep expert groups on their node,
and convert and checkpoint as the unreplicated model (each expert stored once)."""
from __future__ import annotations

import pytest
import torch

from megamoe.core.errors import ConfigError
from megamoe.core.placement import router_index, split_group
from megamoe.layers.mlp.replicas import ExpertReplicas
from megamoe.planning.placement import balanced_order, imbalance, replicated_placement
from tests.numerics import rel_err
from tests.test_moe_parallel import CONFIGS, H, batches, build_moe, check, parity_case

REL = 1e-6


def replicated(replicas: list[int], layer: int = 0) -> dict:
    return dict(redundant_experts=len(replicas), replicas={str(layer): replicas})


def test_slots_exchange_and_token_split():
    """E=8 over 2 ranks + copies of experts 5 (on rank 0) and 0 (on rank 1): 5 slots a rank; an
    expert's kept pairs alternate between its copies in (token, k) order."""
    r = ExpertReplicas(8, [5, 0], ep=2, ep_rank=0)
    assert r.num_slots == 10 and r.slots[0] == [0, 9] and r.slots[5] == [6, 4] and r.slots[3] == [3]
    assert (r.send_rows, r.in_splits, r.out_splits, r.arrival) == ([0], [0, 1], [0, 1], [0])
    idx = torch.tensor([[0, 5], [0, 1], [5, 0], [0, 5], [0, 2]])
    assert r.route(idx).reshape(-1).tolist() == [0, 6, 9, 1, 4, 0, 9, 6, 0, 2]
    keep = torch.ones_like(idx, dtype=torch.bool)
    keep[1, 0] = False  # a dropped pair does not count
    assert r.route(idx, keep).reshape(-1)[keep.reshape(-1)].tolist() == [0, 6, 1, 4, 9, 0, 6, 9, 2]


def _spy_replica_rows(layer, monkeypatch) -> list[int]:
    """Rows the layer's replica slots compute (its role's ``compute`` on fetched weights)."""
    rows, base = [], layer.experts.compute

    def compute(x, idx, counts, probs, w1, w2, out_rows, experts=None):
        if w1 is not layer.experts.gate_up_weight:  # not the role's own forward
            rows.append(sum(counts))
        return base(x, idx, counts, probs, w1, w2, out_rows, experts)

    monkeypatch.setattr(layer.experts, "compute", compute)
    return rows


@pytest.mark.parametrize("config", ["softmax", "sigmoid"])
def test_replicated_layer_equals_the_unreplicated_one(config, monkeypatch):
    """One process: 3 extra slots (expert 1 twice, expert 6 once); same parameters, same outputs
    and gradients (1e-6), with capacity drops in the sigmoid case."""
    ref, rep = build_moe(CONFIGS[config]), build_moe(dict(CONFIGS[config], **replicated([1, 6, 1])))
    assert rep.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(p, q) for p, q in zip(rep.parameters(), ref.parameters()))
    rows = _spy_replica_rows(rep, monkeypatch)
    x = torch.randn(4, 8, H, generator=torch.Generator().manual_seed(3))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(xi) for m, xi in zip((ref, rep), xs)]
    for y, xi in zip(ys, xs):
        (y * torch.linspace(-1, 1, H)).sum().backward()
    assert rows and rows[0] > 0, "no pair went to a replica slot"
    assert rel_err(ys[1], ys[0]) < REL and rel_err(xs[1].grad, xs[0].grad) < REL
    for (name, p), q in zip(rep.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None) and (q.grad is None or rel_err(p.grad, q.grad) < REL), name


def replica_case(config: str, parallel: dict, dispatcher: str, replicas: list[int], overlap: bool = False) -> dict:
    """``overlap``: the shared expert overlapped with the all-to-alls (model.moe.shared_expert_overlap)."""
    return parity_case(config, parallel, dispatcher=dispatcher,
                       extra=dict(replicated(replicas), shared_expert_overlap=overlap))


@pytest.mark.parametrize("case", [
    ("softmax", dict(ep=2), "alltoall", [5, 0], True),
    ("sigmoid", dict(ep=2), "allgather", [1, 6]),
], ids=["ep2-alltoall-overlap", "ep2-allgather-capacity"])
def test_replicas_at_ep2_equal_one_process(pool, case):
    results = pool(2).run(replica_case, *case)
    check(results)
    assert sum(r["_replica_pairs"] for r in results) > 0


@pytest.mark.parametrize("case", [
    ("sigmoid-dropless", dict(ep=4), "alltoall", [2, 0, 7, 0]),
    ("softmax", dict(ep=2, etp=2), "alltoall", [5, 0]),
], ids=["ep4-alltoall", "ep2-etp2-alltoall"])
def test_replicas_at_ep4_equal_one_process(pool, case):
    results = pool(4).run(replica_case, *case)
    check(results)
    assert sum(r["_replica_pairs"] for r in results) > 0


def training_case(replicas: list[int], steps: int = 3) -> dict:
    """AdamW steps of a replicated layer at EP=2 and of one unreplicated process on both ranks'
    batches: parameters equal after every step, and the replicas fetched equal their experts."""
    from megamoe.core.config import ParallelConfig
    from megamoe.model.weights import finalize_grads
    from megamoe.parallel import comm
    from megamoe.parallel.groups import build_groups
    from megamoe.parallel.record import is_expert_param
    from megamoe.parallel.sharding import gather_full

    groups = build_groups(ParallelConfig(ep=2))
    moe = CONFIGS["softmax"]
    ref, model = build_moe(moe), build_moe(dict(moe, **replicated(replicas)), groups)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    errs = {}
    for step in range(steps):
        data = batches(2, seed=10 + step)
        sum((ref(x) * g).sum() for x, g in data).backward()
        x, g = data[groups.rank("dp")]
        (model(x) * g).sum().backward()
        finalize_grads(model, groups)
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            comm.all_reduce_tensor(p.grad, groups.edp if is_expert_param(p) else groups.dp_cp)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            errs[f"step {step} {name}"] = rel_err(gather_full(p, groups, p.detach()), ref_params[name])
    w1, w2 = model.replicas.fetch(model.experts.gate_up_weight.detach(), model.experts.down_weight.detach())
    mine = [replicas[i] for i in range(len(replicas)) if i // (len(replicas) // 2) == groups.rank("ep")]
    errs["replica gate_up"] = rel_err(w1, ref.experts.gate_up_weight[mine])
    errs["replica down"] = rel_err(w2, ref.experts.down_weight[mine])
    full = gather_full(model.experts.gate_up_weight, groups, model.experts.gate_up_weight.detach())
    errs["_replica equals its expert"] = bool(torch.equal(w1, full[mine]))
    return errs


def test_replicas_stay_equal_through_training(pool):
    for rank, errs in enumerate(pool(2).run(training_case, [5, 0, 6, 1])):
        assert errs["_replica equals its expert"]
        bad = {k: v for k, v in errs.items() if not k.startswith("_") and v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def _skewed_pairs(e_count: int = 64, tokens: int = 4096, top_k: int = 8) -> torch.Tensor:
    """[tokens, top_k] expert ids drawn from test_placement's skewed load (rand^4)."""
    gen = torch.Generator().manual_seed(0)
    load = torch.rand(e_count, generator=gen) ** 4 + 1e-3
    return torch.multinomial(load.expand(tokens, e_count), top_k, generator=gen)


def _dispatched(idx: torch.Tensor, order: list[int], replicas: list[int], ep: int) -> float:
    """Busiest EP rank / mean over the rows the dispatcher really sends: ``idx`` (HF ids) through
    the placement and ``ExpertReplicas.route`` into slots."""
    where = torch.tensor(router_index(range(len(order)), order))
    slots = ExpertReplicas(len(order), router_index(replicas, order), ep).route(where[idx])
    rows = torch.bincount(slots.reshape(-1) // ((len(order) + len(replicas)) // ep), minlength=ep).double()
    return (rows.max() / rows.mean()).item()


@pytest.mark.parametrize("n_group", [8, 1])
def test_skewed_router_at_ep4_busiest_rank_within_5_percent(n_group):
    """64 experts at EP=4, test_placement's skewed load (rand^4): placement alone takes the busiest
    rank from 1.42x the mean to 1.09x with 8 groups (1.00x without); 8 replicas (2 per rank) keep
    it <= 1.05x, in the plan and in the rows the dispatcher sends for routed pairs drawn from it."""
    load = (torch.rand(64, generator=torch.Generator().manual_seed(0)) ** 4 * 1000).tolist()
    placed = balanced_order(load, 4, n_group)
    order, replicas = replicated_placement(load, 4, 8, n_group)
    before, after = imbalance(load, range(64), 4), imbalance(load, order, 4, replicas)
    print(f"n_group={n_group}: before {before:.3f}, placed {imbalance(load, placed, 4):.3f}, replicated {after:.3f}")
    assert before == pytest.approx(1.42, abs=0.005) and after <= 1.05
    assert sorted(order) == list(range(64)) and len(replicas) == 8
    if n_group > 1:
        assert imbalance(load, placed, 4) == pytest.approx(1.09, abs=0.005)
        assert split_group(order, n_group) is None
    idx = _skewed_pairs()
    routed = torch.bincount(idx.reshape(-1), minlength=64).tolist()
    order, replicas = replicated_placement(routed, 4, 8, n_group)
    planned, measured = imbalance(routed, order, 4, replicas), _dispatched(idx, order, replicas, 4)
    print(f"  routed pairs: before {imbalance(routed, range(64), 4):.3f}, "
          f"placed {imbalance(routed, balanced_order(routed, 4, n_group), 4):.3f}, replicated {measured:.3f}")
    assert measured <= 1.05 and measured == pytest.approx(planned, abs=2e-3)


def test_group_replicas_stay_on_their_node():
    """n_group=8, EP=4 on 2 nodes of 2 ranks: every replica sits on the node that holds its group."""
    load = torch.bincount(_skewed_pairs().reshape(-1), minlength=64).tolist()
    order, replicas = replicated_placement(load, 4, 8, 8, ep_per_node=2)
    home = {e: s // 16 for s, e in enumerate(order)}
    assert split_group(order, 8) is None
    assert all(i // 2 // 2 == home[e] // 2 for i, e in enumerate(replicas)), (order, replicas)
    assert imbalance(load, order, 4, replicas) < imbalance(load, balanced_order(load, 4, 8), 4)


def test_group_limited_replicated_layer_equals_the_unplaced_one():
    """n_group=8: groups moved and experts swapped inside them (the placement), plus replicas named
    by HF id: the same outputs and input gradients as the plain layer."""
    moe = dict(num_experts=16, top_k=4, moe_ffn_hidden_size=8, score_function="sigmoid", n_group=8, topk_group=3,
               expert_bias=True, num_shared_experts=0)
    order = [2 * g + i for g in [5, 2, 7, 0, 1, 6, 3, 4] for i in (1, 0)]
    ref = build_moe(moe)
    placed = build_moe(dict(moe, placement={"0": order}, **replicated([0, 11, 11, 3])))
    with torch.no_grad():
        for name, p in placed.named_parameters():
            p.copy_(dict(ref.named_parameters())[name].index_select(0, torch.tensor(order)) if name.startswith(
                ("router.", "experts.")) else dict(ref.named_parameters())[name])
        placed.router.expert_bias.copy_(ref.router.expert_bias.index_select(0, torch.tensor(order)))
    assert placed.replicas.slots[order.index(11)][1:] == [17, 18]  # HF expert 11's two copies
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(3))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(xi) for m, xi in zip((ref, placed), xs)]
    for y, xi in zip(ys, xs):
        y.square().sum().backward()
    assert rel_err(ys[1], ys[0]) < REL and rel_err(xs[1].grad, xs[0].grad) < REL


def test_plan_import_export_and_checkpoint_with_replicas(tmp_path, capsys):
    """plan experts --redundant prints both figures and writes the replicas; import-hf records them
    (each expert stored once); the checkpoint's model equals the HF model; export gives the HF
    tensors back bitwise; a DCP save/load round-trips; a resume that changes them is refused."""
    import json

    from safetensors.torch import load_file

    from megamoe.checkpoint.dcp import load_checkpoint, read_meta, save_checkpoint
    from megamoe.commands.convert import main as convert
    from megamoe.commands.plan import main as plan
    from megamoe.convert import from_hf
    from megamoe.convert.api import open_megamoe_checkpoint
    from megamoe.core.config import ExpertStoreConfig
    from megamoe.core.config_io import config_to_dict
    from megamoe.core.placement import write_json
    from megamoe.inference.load import load_model
    from megamoe.planning.placement import calibrate
    from megamoe.training.guards import CheckpointMismatch, check_unchanged
    from tests.test_placement import _batches, _skewed_hf

    original = _skewed_hf(tmp_path / "hf")
    plain = from_hf(tmp_path / "hf")
    write_json(tmp_path / "load.json", calibrate(plain, _batches()))
    plan(["experts", "--load", str(tmp_path / "load.json"), "--ep", "2", "--redundant", "2",
          "--out", str(tmp_path / "place.json")])
    printed = capsys.readouterr().out.splitlines()
    assert "with 2 replicas" in printed[0]
    before, placed, after = map(float, printed[1].split()[2:5])
    assert after <= placed <= before and after < 1.05, printed
    replicas = json.loads((tmp_path / "place.json").read_text())["replicas"]["1"]
    convert(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--ep", "2",
             "--placement", str(tmp_path / "place.json")])
    meta, cfg, _, _ = open_megamoe_checkpoint(tmp_path / "ckpt")
    assert meta["model"]["moe"]["redundant_experts"] == 2 and cfg.moe.replicas == {"1": replicas}
    model = load_model(tmp_path / "ckpt")
    assert model.layers["1"].mlp.replicas.num_slots == 10
    assert tuple(model.layers["1"].mlp.experts.gate_up_weight.shape)[0] == 8  # each expert once
    ids = _batches()[0]
    with torch.no_grad():
        assert rel_err(model(ids), plain(ids)) < REL
    tiered = load_model(tmp_path / "ckpt", expert_store=ExpertStoreConfig(budget_mib=1))  # decoding from a store
    with torch.no_grad():
        assert tiered.layers["1"].mlp.replicas is None and rel_err(tiered(ids), plain(ids)) < REL
    convert(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "back")])
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)

    saved = config_to_dict(model.config)
    path = save_checkpoint(tmp_path / "run", 1, model.groups, [model], extra_meta={"model": saved})
    other = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    load_checkpoint(path, model.groups, [other])
    with torch.no_grad():
        assert torch.equal(other(ids), model(ids))
    meta = read_meta(path)
    assert meta["model"]["moe"]["replicas"] == {"1": replicas}
    changed = json.loads(json.dumps(saved))
    changed["moe"]["redundant_experts"], changed["moe"]["replicas"] = 0, None
    with pytest.raises(CheckpointMismatch, match="model.moe.re"):
        check_unchanged(path, meta, {"model": changed})


def test_bad_replica_settings_are_one_line():
    from megamoe.recipe import load_recipe, load_train_recipe

    with pytest.raises(ConfigError, match=r"model.moe.replicas: layer 0 must list model.moe.redundant_experts=2"):
        load_recipe("tiny_hybrid_moe", ["model.moe.redundant_experts=2", "model.moe.replicas={'0': [1, 99]}"])
    with pytest.raises(ConfigError, match=r"model.moe.replicas=.* needs redundant_experts > 0"):
        load_recipe("tiny_hybrid_moe", ["model.moe.replicas={'0': [1]}"])
    with pytest.raises(ConfigError, match=r"redundant_experts=3 is invalid: must be divisible by parallel.ep=2"):
        load_train_recipe("tiny_hybrid_moe", ["model.moe.redundant_experts=3", "parallel.ep=2"], False).validate_plan()
    with pytest.raises(ConfigError, match=r"redundant_experts=2 is invalid with a lora section"):
        load_train_recipe("tiny_moe_lora", ["model.moe.redundant_experts=2"], False).validate_plan()
    with pytest.raises(ConfigError, match=r"--redundant=3 needs --ep > 1 dividing it"):
        replicated_placement([1.0] * 8, 2, 3)


def test_planner_counts_the_replica_slots():
    """Each MoE layer's N/ep fetched replicas: N/E of the rank's routed-expert bytes, per micro-batch
    in flight."""
    from megamoe.core.config import ParallelConfig
    from megamoe.planning.plan import stage_memory
    from megamoe.recipe import load_recipe

    rows = {}
    for n in (0, 4):
        cfg = load_recipe("tiny_hybrid_moe", [f"model.moe.redundant_experts={n}"]).model
        rows[n] = stage_memory(cfg, ParallelConfig(ep=2), 2, 1, 64)[0]
    moe = cfg.moe
    experts = 3 * moe.num_experts * moe.moe_ffn_hidden_size * cfg.hidden_size // 2 * 4  # fp32, half on a rank
    layers = sum(1 for k in cfg.parsed_layout().layers if k.mlp == "e")
    assert rows[4]["activations"] - rows[0]["activations"] == pytest.approx(layers * experts * 4 / moe.num_experts)
    assert rows[4]["weights"] == rows[0]["weights"]


def trainer_case(log_dir: str, redundant: int, steps: int = 4) -> list[tuple[float, float]]:
    """The trainer (ZeRO-1, clipping, bias update) at EP=2 on tests/test_trainer_parity.py's tiny
    hybrid MoE (4 experts): (loss, grad norm) per step; ``redundant`` default-spread replicas (each
    rank copies an expert of the other)."""
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer
    from megamoe.core.config import ParallelConfig
    from tests.test_trainer_parity import tiny_recipe

    recipe = tiny_recipe(ParallelConfig(ep=2), steps=steps)
    recipe.model.moe.redundant_experts = redundant
    trainer = Trainer(recipe, SyntheticDataset(recipe.model.vocab_size, recipe.data.seq_len, seed=recipe.data.seed))
    return [(h["loss"], h["grad_norm"]) for h in trainer.fit(log_dir)]


def test_trainer_with_replicas_follows_the_unreplicated_run(pool, tmp_path):
    plain = pool(2).run(trainer_case, str(tmp_path / "plain"), 0)[0]
    copies = pool(2).run(trainer_case, str(tmp_path / "copies"), 2)[0]
    assert len(copies) == len(plain) == 4
    for (loss, norm), (loss0, norm0) in zip(copies, plain):
        assert loss == pytest.approx(loss0, rel=1e-6) and norm == pytest.approx(norm0, rel=1e-5)
