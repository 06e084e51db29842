"""Expert placement (megamoe/core/placement.py): balanced slot orders from measured load, applied by
the converter, invisible in the outputs and in the HF files written back."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megamoe.core.errors import ConfigError
from megamoe.core.placement import read_load, write_json
from megamoe.planning.placement import balanced_order, calibrate, imbalance
from tests.numerics import rel_err

E, EP = 8, 2


def test_balanced_order_fills_every_rank_and_evens_the_load():
    load = [100, 90, 5, 5, 5, 5, 1, 1]                    # two hot experts, both on rank 0 as given
    order = balanced_order(load, EP)
    assert sorted(order) == list(range(E))
    assert {e for e in order[:4]} & {0, 1} and {e for e in order[4:]} & {0, 1}   # the hot pair split
    assert imbalance(load, range(E), EP) > 1.8 and imbalance(load, order, EP) < 1.1
    assert balanced_order(load, EP) == order                                    # deterministic
    with pytest.raises(ConfigError, match="must divide the 8 experts"):
        balanced_order(load, 3)


def _skewed_hf(path):
    """A tiny Qwen3-MoE (layers d, e, d) with 8 experts whose router rows 0 and 1 are scaled 4x:
    those two experts take about half of the tokens each, so rank 0 of EP=2 is the busiest."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.test_convert_qwen import SHAPE, randomized

    cfg = Qwen3MoeConfig(num_hidden_layers=3, intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
                         **dict(SHAPE, num_experts=E))
    model = randomized(Qwen3MoeForCausalLM(cfg))
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[:2] *= 4
    model.save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (4, 32), generator=g) for _ in range(4)]


def test_calibrated_placement_evens_the_busiest_rank_and_changes_no_output(tmp_path):
    from megamoe.convert import from_hf, to_hf

    original = _skewed_hf(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    load = calibrate(model, _batches())
    assert list(load) == [1] and len(load[1]) == E
    order = balanced_order(load[1], EP)
    before, after = imbalance(load[1], range(E), EP), imbalance(load[1], order, EP)
    assert before > 1.2 and after < before and after < 1.1, (before, after)

    placed = from_hf(tmp_path / "hf", placement={1: order})
    assert placed.config.moe.placement == {"1": order}
    ids = _batches()[0]
    with torch.no_grad():
        assert rel_err(placed(ids), model(ids)) < 1e-6
    # measured on the placed model, rank r's slots carry what the plan said they would
    placed_load = calibrate(placed, _batches())[1]
    assert imbalance(placed_load, range(E), EP) == pytest.approx(after)
    # HF files always hold the logical order
    to_hf(placed, tmp_path / "back")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)


def test_import_with_a_placement_file_and_export(tmp_path):
    from megamoe.commands.convert import main as convert
    from megamoe.commands.plan import main as plan
    from megamoe.convert import from_hf
    from megamoe.convert.api import open_megamoe_checkpoint

    original = _skewed_hf(tmp_path / "hf")
    write_json(tmp_path / "load.json", calibrate(from_hf(tmp_path / "hf"), _batches()))
    plan(["experts", "--load", str(tmp_path / "load.json"), "--ep", "2", "--out", str(tmp_path / "place.json")])
    convert(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--ep", "2",
             "--placement", str(tmp_path / "place.json")])
    meta, cfg, _, _ = open_megamoe_checkpoint(tmp_path / "ckpt")
    assert meta["model"]["moe"]["placement"]["1"] == cfg.moe.placement["1"] != list(range(E))
    convert(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "back")])
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_bad_load_and_placement_files_are_one_line(tmp_path):
    from megamoe.recipe import load_recipe

    (tmp_path / "bad.json").write_text('{"layers": {"x": [1]}}')
    with pytest.raises(ConfigError, match=r"bad.json: layers.x must be a layer number"):
        read_load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no such expert-load file"):
        read_load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"model.moe.placement: layer 0 must order each of the 8 experts once"):
        load_recipe("tiny_hybrid_moe", ["model.moe.placement={'0': [0, 1, 2, 3, 4, 5, 6, 6]}"])
    with pytest.raises(ConfigError, match="group-limited routing"):
        load_recipe("tiny_hybrid_moe", ["model.moe.placement={'0': [0, 4, 2, 3, 1, 5, 6, 7]}", "model.moe.n_group=2"])


def test_calibrate_command_measures_the_load_on_user_text(tmp_path):
    """megamoe-plan experts --calibrate: an HF model routes a text file's tokens; the measured
    load and the placement are written, and the placement balances that load."""
    import json

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megamoe.commands.plan import main as plan
    from tests.test_convert_qwen import SHAPE, randomized

    cfg = Qwen3MoeConfig(num_hidden_layers=2, intermediate_size=40, decoder_sparse_step=1, norm_topk_prob=False,
                         **dict(SHAPE, num_experts=E, vocab_size=320))
    model = randomized(Qwen3MoeForCausalLM(cfg))
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight[:2] *= 4
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "data.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    plan(["experts", "--calibrate", str(tmp_path / "hf"), "--text", str(tmp_path / "data.txt"), "--tokenizer",
          "byte", "--seq-len", "64", "--ep", "2", "--save-load", str(tmp_path / "load.json"),
          "--out", str(tmp_path / "place.json")])
    load = read_load(tmp_path / "load.json")
    placement = json.loads((tmp_path / "place.json").read_text())["layers"]
    assert sorted(load) == [0, 1] and sum(load[0]) == 2 * (len("the quick brown fox jumps over the lazy dog. ") * 40
                                                            // 64) * 64
    for layer, counts in load.items():
        assert imbalance(counts, placement[str(layer)], EP) <= imbalance(counts, range(E), EP)


def test_group_limited_placement_keeps_groups_whole_and_evens_the_load():
    """n_group=8 (DeepSeek-V3's): 64 experts, 4 ranks of 2 whole groups; 4 groups spread over 4
    ranks each; a skewed load evened either way, every group in one block of slots."""
    from megamoe.core.placement import split_group

    load = (torch.rand(64, generator=torch.Generator().manual_seed(0)) ** 4 * 1000).tolist()
    for ep, n_group in ((4, 8), (16, 4)):
        order = balanced_order(load, ep, n_group)
        assert sorted(order) == list(range(64)) and split_group(order, n_group) is None
        assert imbalance(load, order, ep) < imbalance(load, range(64), ep)
    with pytest.raises(ConfigError, match="do not nest"):
        balanced_order(load[:48], 16, 12)  # 3 experts per rank, groups of 4


def test_group_limited_placement_changes_no_output():
    """Whole groups moved between blocks and experts moved inside their group: the same experts
    chosen for every token (outputs and input gradients equal the unplaced layer)."""
    from megamoe.core.placement import check_placement
    from tests.test_moe_parallel import H, build_moe

    moe = dict(num_experts=16, top_k=4, moe_ffn_hidden_size=8, score_function="sigmoid", n_group=8, topk_group=3,
               expert_bias=True, num_shared_experts=0)
    groups = [5, 2, 7, 0, 1, 6, 3, 4]
    order = [2 * g + i for g in groups for i in (1, 0)]  # blocks permuted, each group's two experts swapped
    assert check_placement({0: order}, 16, [0], n_group=8) == {0: order}
    ref, placed = build_moe(moe), build_moe(moe)
    with torch.no_grad():
        for name, p in placed.named_parameters():
            if name.startswith(("router.", "experts.")):
                p.copy_(dict(ref.named_parameters())[name].index_select(0, torch.tensor(order)))
        placed.router.expert_bias.copy_(ref.router.expert_bias.index_select(0, torch.tensor(order)))
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(3))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(xi) for m, xi in zip((ref, placed), xs)]
    for y, xi in zip(ys, xs):
        y.square().sum().backward()
    assert rel_err(ys[1], ys[0]) < 1e-6 and rel_err(xs[1].grad, xs[0].grad) < 1e-6


def calibrate_case() -> dict:
    """Each of 2 ranks routes its own batches; the summed counts equal one process routing all."""
    import torch.distributed as dist

    from megamoe.core.config import AttentionConfig, ModelConfig, MoEConfig
    from megamoe.model.build import build_model
    from megamoe.model.weights import initialize
    from megamoe.parallel.groups import ParallelGroups

    cfg = ModelConfig(vocab_size=64, hidden_size=16, layout="AeAe", attention=AttentionConfig(num_heads=2, num_kv_heads=2),
                      moe=MoEConfig(num_experts=8, top_k=2, moe_ffn_hidden_size=8))
    model = build_model(cfg)
    initialize(model, ParallelGroups(), 0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(4)]
    rank = dist.get_rank()
    return {"merged": calibrate(model, batches[rank::2], dist.group.WORLD), "alone": calibrate(model, batches)}


def test_calibration_distributed_and_merged(pool):
    for r in pool(2).run(calibrate_case):
        assert r["merged"] == r["alone"] and sorted(r["merged"]) == [0, 1] and sum(r["merged"][0]) == 4 * 2 * 16 * 2
