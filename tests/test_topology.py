"""Node topology: TP and ETP inside a node (refused across, in one line), EP inside where it fits
(logged with its traffic otherwise); megatron-core's rank numbering really keeps the groups there
(4 gloo processes as 2 nodes of 2)."""
from __future__ import annotations

import pytest

from megamoe.core.config import ParallelConfig
from megamoe.core.errors import ConfigError
from megamoe.parallel.topology import check_topology, nodes_spanned, remote_share


def test_rule_and_refusals():
    assert check_topology(ParallelConfig(tp=8, ep=8), 64, node=8) == {"tp": 1, "etp": 1, "ep": 1, "tp_cp": 1}
    assert check_topology(ParallelConfig(tp=8, ep=64), 512, node=8)["ep"] == 8
    assert nodes_spanned(4, 6) == 2 and nodes_spanned(16, 8) == 2
    assert remote_share(ParallelConfig(ep=32), 8) == pytest.approx(0.75)
    assert remote_share(ParallelConfig(ep=4, etp=2), 8) == 0.0
    for parallel, node, field in ((ParallelConfig(tp=16), 8, "parallel.tp=16"),
                                  (ParallelConfig(etp=4, ep=2), 6, "parallel.etp=4"),
                                  (ParallelConfig(tp=2), 3, "parallel.gpus_per_node=3")):
        with pytest.raises(ConfigError) as e:
            check_topology(parallel, 24 if node != 3 else 16, node=node)
        assert str(e.value).startswith(field) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="parallel.gpus_per_node=0"):
        ParallelConfig(gpus_per_node=0).validate()


def test_ep_across_nodes_is_described_with_its_traffic():
    from megamoe.planning.traffic import describe_ep_span, ep_bytes
    from tests.test_trainer_parity import tiny_recipe

    recipe = tiny_recipe(ParallelConfig(ep=4))  # 4 experts top-2, hidden 32, 3 MoE layers (GeAd|SeGe), 8 x 16 tokens
    assert describe_ep_span(recipe, recipe.parallel, 4, node=4) is None
    # per rank: 8*16/4 tokens x 2 experts x (4 rows x 32 x 4 bytes + 8) + counts 4 x 8 bytes x 1 micro-batch
    per_layer = 8 * 16 / 4 * 2 * (4 * 32 * 4 + 8) + 8 * 4 * 1
    assert ep_bytes(recipe, recipe.parallel, 4, act_bytes=4) == per_layer * 3
    line = describe_ep_span(recipe, recipe.parallel, 4, node=2, act_bytes=4)
    assert line.startswith("parallel.ep=4 x etp=1 spans 2 nodes of 2 GPUs") and "(50% of" in line


def group_spans(parallel: dict) -> dict:
    from megamoe.parallel.groups import build_groups
    from megamoe.parallel.topology import group_nodes

    try:
        groups = build_groups(ParallelConfig(**parallel, gpus_per_node=2))
    except ConfigError as e:
        return {"refused": str(e)}
    return {name: group_nodes(getattr(groups, name), 2) for name in ("tp", "ep", "etp", "tp_ep", "dp", "edp")}


def test_groups_inside_nodes_on_four_ranks(pool):
    run = pool(4).run
    for spans in run(group_spans, dict(tp=2, ep=2)):  # TP, EP inside a node; DP across
        assert spans == {"tp": 1, "ep": 1, "etp": 1, "tp_ep": 1, "dp": 2, "edp": 2}, spans
    for spans in run(group_spans, dict(ep=2, etp=2)):  # ETP inside a node, EP x ETP across
        assert spans["etp"] == 1 and spans["ep"] == 2 and spans["tp_ep"] == 2, spans
    for spans in run(group_spans, dict(tp=4)):
        assert spans["refused"].startswith("parallel.tp=4 is invalid: it would put tensor parallelism across nodes")
