"""One record per parameter (megamoe.parallel.record): every parameter of a model carries its
facts in one frozen record and in no other attribute; the setters replace it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.parallel.record import ParamRecord, is_expert_param, record, update_record
from megamoe.parallel.sharding import Shard, mark_init, mark_partial_grad, normal_init, set_sharding
from tests.lora_utils import build_lora_model, lora_model_config


def test_every_parameter_has_one_record_and_nothing_else():
    model = build_lora_model(lora_model_config(), expert_adapters="per_expert")
    names = dict(model.named_parameters())
    for name, p in names.items():
        rec = record(p)
        assert rec.init is not None, name  # every parameter knows its init rule
        extra = [k for k in vars(p) if k.startswith("_megamoe") and k != "_megamoe"]
        assert extra == [], (name, extra)
    experts = {n for n, p in names.items() if is_expert_param(p)}
    assert "layers.0.mlp.experts.gate_up_weight" in experts and "layers.0.mlp.experts.down_lora_B" in experts
    assert not any("shared_experts" in n or "router" in n for n in experts)
    assert record(names["layers.0.mlp.experts.gate_up_weight"]).active_fraction == 0.5  # top 2 of 4
    assert record(names["layers.0.mlp.shared_experts.linear_fc1.weight"]).active_fraction == 1.0


def test_setters_replace_the_frozen_record():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    assert record(p) == ParamRecord()
    set_sharding(p, Shard(0, "tp"))
    first = record(p)
    mark_partial_grad(p, "etp")
    mark_partial_grad(p, "etp")  # once per group
    mark_init(p, normal_init(0.1))
    assert record(p).shard == (Shard(0, "tp"),) and record(p).partial_grad == ("etp",)
    assert first.partial_grad == () and first.init is None  # the earlier record is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        record(p).active_fraction = 0.5
    update_record(p, active_fraction=0.25)
    assert record(p).active_fraction == 0.25 and record(p).shard == (Shard(0, "tp"),)
    assert record(torch.nn.Parameter(torch.zeros(1))) == ParamRecord()  # the default is not shared state
