"""``moe.dispatcher: static``: the expert exchange padded to capacity, with no host synchronisation.

At EP=2 it equals one process (outputs, input, router and expert gradients, balancing losses and
loads, fp32, relative error <= 1e-5), with capacity drops and with a capacity that drops nothing,
and a forward and backward of the layer reads nothing on the host (the ``alltoall`` dispatcher's
one read per layer is its count exchange, tests/test_host_sync.py).
"""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import ModelConfig, MoEConfig, ParallelConfig
from megamoe.core.errors import ConfigError
from tests.test_generate_compiled import needs_compiler, prompts
from tests.test_moe_parallel import CONFIGS, H, REL, build_moe, parity_case

# softmax scores: capacity factor E / k = 4 gives C = T, which no expert can exceed
CONFIGS["softmax-roomy"] = dict(CONFIGS["softmax"], capacity_factor=4.0)


def static_case(config: str) -> dict:
    from megamoe.diagnostics.host_sync import HostSyncCounter
    from megamoe.parallel.groups import build_groups

    errs = parity_case(config, dict(ep=2), dispatcher="static")
    layer = build_moe(dict(CONFIGS[config], dispatcher="static"), build_groups(ParallelConfig(ep=2)))
    with HostSyncCounter() as c:
        layer(torch.randn(2, 8, H, requires_grad=True)).sum().backward()
    errs["_syncs"], errs["_table"] = c.count("layers/"), c.table()
    return errs


@pytest.mark.parametrize("config,drops", [("sigmoid", True), ("softmax-roomy", False)],
                         ids=["capacity-drops", "capacity-drops-nothing"])
def test_static_dispatch_at_ep2_equals_one_process_without_host_reads(pool, config, drops):
    for rank, errs in enumerate(pool(2).run(static_case, config)):
        bad = {k: v for k, v in errs.items() if not k.startswith("_") and v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"
        assert "grad router.weight" in errs and "grad experts.down_weight" in errs
        assert (errs["_dropped"] > 0) == drops, errs["_dropped"]
        assert errs["_syncs"] == 0, f"rank {rank}:\n{errs['_table']}"


def test_static_dispatch_slots_fill_each_expert_in_token_order():
    from megamoe.layers.mlp.static_dispatch import StaticAllToAllDispatcher
    from megamoe.parallel.groups import ParallelGroups

    d = StaticAllToAllDispatcher(4, ParallelGroups(), capacity_factor=1.0, top_k=2)
    key = torch.tensor([[0, 2], [0, -1], [0, 3], [2, 0]])  # expert 0 gets 4 pairs, capacity 2
    assert d.capacity(4) == 2
    slots = d.slots(key, 2).view(4, 2).tolist()
    assert slots == [[0, 4], [1, 8], [8, 6], [5, 8]], slots  # 8 = 4 * 2: dropped / past capacity


def test_static_dispatch_needs_a_capacity():
    with pytest.raises(ConfigError, match=r"model\.moe\.capacity_factor"):
        ModelConfig(hidden_size=H, layout="Ae", moe=MoEConfig(**dict(CONFIGS["softmax"], dispatcher="static"))).validate()


def static_model(groups):
    from megamoe.core.config import GDNConfig
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize
    from tests.mixer_utils import tiny_model

    cfg = tiny_model("GeAe", gdn=GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                                          chunk_size=8),
                     moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, num_shared_experts=1,
                                   capacity_factor=2.0, dispatcher="static"))
    model = LanguageModel(cfg, groups).eval()
    initialize(model, groups, seed=0)
    return model


def compiled_static_case() -> tuple:
    """EP=2: eager and compiled decoding with the static exchange, and the graph breaks it cost."""
    from torch._dynamo.utils import counters

    from megamoe.inference.generate import generate_batch
    from megamoe.parallel.groups import build_groups

    model = static_model(build_groups(ParallelConfig(ep=2)))
    breaks = sum(counters["graph_break"].values())
    eager = generate_batch(model, prompts(), 5)
    compiled = generate_batch(model, prompts(), 5, compile=True)
    return eager, compiled, sum(counters["graph_break"].values()) - breaks, dict(counters["graph_break"])


@needs_compiler
def test_static_dispatch_compiles_into_the_decode_graph_at_ep2(pool):
    """The exchange has no host-read sizes: at EP=2 each rank's decode step is one graph with the
    all-to-alls inside (the alltoall dispatcher runs outside it), with one process's tokens."""
    from megamoe.inference.generate import generate_batch
    from megamoe.parallel.groups import ParallelGroups

    want = generate_batch(static_model(ParallelGroups()), prompts(), 5)
    for eager, compiled, breaks, table in pool(2).run(compiled_static_case, timeout=900):
        assert eager == want and compiled == want
        assert breaks == 0, "\n".join(f"{n}: {k[:300]}" for k, n in table.items())
