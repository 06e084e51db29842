"""LoRA at TP=2 (+SP), EP=2 and ETP=2 equals one process: logits and every adapter's gradient after
the trainer's gradient sync, fp32, relative error <= 1e-5, per-expert and shared expert adapters.

Each data-parallel replica runs its own batch and the loss is normalised by the global token
count, as in the trainer; the single-process reference runs every replica's batch. The model
has Gated DeltaNet, KDA, MLA and attention (column, row and replicated linears), routed experts with a gated shared
expert, a balancing loss (its gradient reaches the adapters through the frozen router's input)
and the expert bias.
"""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import ParallelConfig
from tests.lora_utils import build_lora_model, lora_model_config, token_batches

REL = 1e-5
B, S = 2, 8
LAYOUT = "GeKdMeAe"  # fused column parts (G, A), replicated latents (K, M), row outputs, experts


def _loss_sum(model, ids):
    from megamoe.model.language_model import shift_labels
    from megamoe.parallel.cross_entropy import vocab_parallel_cross_entropy

    logits = model.forward_stage(ids)
    loss = vocab_parallel_cross_entropy(logits, shift_labels(ids), model.groups.tp, model.config.vocab_size).sum()
    return loss, logits


def lora_parity_case(parallel: dict, sp: bool, expert_adapters: str, backend: str = "auto") -> dict:
    from megamoe.lora import lora_parameters
    from megamoe.parallel.groups import build_groups
    from megamoe.parallel.sharding import gather_full
    from megamoe.training.grads import sync_grads
    from tests.numerics import rel_err

    groups = build_groups(ParallelConfig(**parallel, sequence_parallel=sp))
    cfg = lora_model_config(LAYOUT, backend=backend)
    ref = build_lora_model(cfg, expert_adapters=expert_adapters)
    model = build_lora_model(cfg, groups, sp=sp, expert_adapters=expert_adapters)
    dp, me = groups.size("dp"), groups.rank("dp")
    data = token_batches(dp, B, S, cfg.vocab_size)
    tokens = float(dp * B * (S - 1))

    ref_logits = []
    for ids in data:
        loss, logits = _loss_sum(ref, ids)
        (loss / tokens).backward()
        ref_logits.append(ref.gather_logits(logits).detach())
    loss, logits = _loss_sum(model, data[me])
    (loss / tokens).backward()
    sync_grads([model], groups)

    errs = {"logits": rel_err(model.gather_logits(logits), ref_logits[me])}
    ref_params = dict(ref.named_parameters())
    for name, p in lora_parameters(model):
        want = ref_params[name].grad
        assert want is not None and want.abs().sum() > 0, f"reference {name} has no gradient"
        errs[name] = rel_err(gather_full(p, groups, p.grad), want)
    frozen = [n for n, p in model.named_parameters() if "lora_" not in n and p.grad is not None]
    errs["_frozen_with_grad"] = len(frozen)
    return errs


@pytest.mark.parametrize("parallel,sp,experts,backend", [
    (dict(tp=2), True, "per_expert", "auto"),
    (dict(tp=2), False, "shared", "auto"),
    (dict(ep=2), False, "per_expert", "auto"),
    (dict(ep=2), False, "shared", "auto"),
    (dict(etp=2), False, "per_expert", "auto"),
    (dict(etp=2), False, "shared", "auto"),
    (dict(etp=2), False, "per_expert", "local"),  # the adapters in the reference expert loop's form
], ids=["tp2-sp", "tp2-shared", "ep2", "ep2-shared", "etp2", "etp2-shared", "etp2-local"])
def test_lora_parallel_equals_single(pool, parallel, sp, experts, backend):
    for rank, errs in enumerate(pool(2).run(lora_parity_case, parallel, sp, experts, backend)):
        assert errs.pop("_frozen_with_grad") == 0
        assert any("experts.gate_up_lora_A" in k for k in errs) and any("linear_kv_down.lora_B" in k for k in errs)
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"
