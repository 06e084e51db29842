"""Host synchronisations of a training step: at most one per MoE layer and micro-batch.

The counter (``megamoe.diagnostics.host_sync``) spies on tensor reads (``.item()``, ``.tolist()``,
``.cpu()``, ...), value-sized ops (``nonzero``, boolean indexing, ``repeat_interleave`` without
``output_size``) and host collectives. Before the dispatcher kept its counts on the device, one
EP=2 training step paid 5 per MoE layer in ``layers/mlp/dispatch.py`` (the pair counts, the send
and receive splits and the expert counts through ``.tolist()``, and an unsized
``repeat_interleave``); now 1, for both dispatchers, with EP=2 and with ETP=2.
"""
from __future__ import annotations

import torch

from megamoe.core.config import ParallelConfig
from megamoe.diagnostics.host_sync import HostSyncCounter
from tests.test_trainer_parity import tiny_recipe

LAYERS = "layers/"  # the model maths' syncs: what the MoE layer's code pays (the trainer's are per step)


def test_counter_sees_each_kind_with_its_tag():
    from megamoe.parallel import comm

    x = torch.arange(6)
    with HostSyncCounter() as c:
        with comm.tag_scope("layer5"):
            x.sum().item(), x.tolist(), x.cpu(), bool(x[0]), int(x[1])
            x[x > 2], x.nonzero(), torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=15), x.sum(), torch.bincount(x)  # no syncs
    kinds = [e.kind for e in c.events]
    assert kinds == ["item", "tolist", "cpu", "bool", "int", "index", "nonzero", "repeat_interleave"], kinds
    assert c.by_tag() == {"layer5": 8} and c.count("test_host_sync.py") == 8
    assert torch.Tensor.item.__name__ == "item", "the counter must restore what it patched"


def test_local_moe_layer_syncs_once():
    from tests.test_moe_parallel import CONFIGS, H, build_moe

    copies = dict(redundant_experts=2, replicas={"0": [1, 5]})  # redundant experts add none
    for config, extra in (("softmax", {}), ("sigmoid", {}), ("sigmoid", copies)):  # dropless, capacity drops
        layer = build_moe(dict(CONFIGS[config], **extra))
        x = torch.randn(2, 8, H, requires_grad=True)
        with HostSyncCounter() as c:
            layer(x).sum().backward()
        assert c.count(LAYERS) == 1, f"{config} {extra}:\n{c.table()}"


def _micro(trainer) -> list[dict]:
    from megamoe.data.synthetic import SyntheticDataset

    ds = SyntheticDataset(trainer.recipe.model.vocab_size, trainer.recipe.data.seq_len, seed=3)
    b = trainer.train.micro_batch_size
    return [{k: torch.stack([ds[m * b + i][k] for i in range(b)]) for k in ds[0]} for m in range(trainer.n_micro)]


def step_syncs() -> dict:
    """EP=2: the layers' syncs in one training step (after a warm-up step) per MoE layer and
    micro-batch, with the table of every sync of the step; then one forward and backward of a MoE
    layer with the allgather dispatcher at EP=2, the alltoall one at ETP=2 and at EP=2 with redundant
    experts."""
    from megamoe.parallel.groups import build_groups
    from megamoe.training.trainer import Trainer
    from tests.test_moe_parallel import CONFIGS, H, build_moe

    recipe = tiny_recipe(ParallelConfig(ep=2), steps=2)
    recipe.model.layout = "AeGe"
    trainer = Trainer(recipe)
    micro = _micro(trainer)
    trainer.train_step(micro)
    with HostSyncCounter() as c:
        trainer.train_step(micro)
    out = {"step": (c.count(LAYERS) / (2 * trainer.n_micro), trainer.n_micro, c.table())}
    copies = dict(redundant_experts=2, replicas={"0": [5, 0]})  # each rank a copy of the other's expert
    for parallel, dispatcher, extra in ((dict(ep=2), "allgather", {}), (dict(etp=2), "alltoall", {}),
                                        (dict(ep=2), "alltoall", copies)):
        layer = build_moe(dict(CONFIGS["sigmoid"], dispatcher=dispatcher, **extra),
                          build_groups(ParallelConfig(**parallel)))
        with HostSyncCounter() as c:
            layer(torch.randn(2, 8, H, requires_grad=True)).sum().backward()
        out[f"{parallel} {dispatcher} {extra}"] = (c.count(LAYERS), 1, c.table())
    return out


def test_ep_training_step_syncs_once_per_moe_layer(pool):
    for rank, got in enumerate(pool(2).run(step_syncs)):
        assert got["step"][1] == 2, "two micro-batches per rank"
        for case, (per_layer, _, table) in got.items():
            assert per_layer <= 1, f"{case} rank {rank}:\n{table}"
