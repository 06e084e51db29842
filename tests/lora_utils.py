"""Shared by the LoRA tests: a tiny hybrid MoE with every mixer and adapters that are not zero."""
from __future__ import annotations

import math

import torch

from megamoe.core.config import MoEConfig
from tests.mixer_utils import tiny_model

# every mixer letter; routed experts with a gated shared expert; dense MLPs
LAYOUT = "GeKdMeLdAeSdDdIe"
MOE = dict(num_experts=4, top_k=2, moe_ffn_hidden_size=16, num_shared_experts=1, shared_expert_gate=True,
           aux_loss_coeff=0.01, expert_bias=True)


def lora_model_config(layout: str = LAYOUT, backend: str = "auto", **moe):
    return tiny_model(layout, backend=backend, moe=MoEConfig(**{**MOE, **moe}))


def randomize_adapters(model, groups=None, seed: int = 5, std: float = 0.1) -> None:
    """Every adapter from full tensors drawn from ``seed`` (B is zero after init, which would
    hide A's gradient and every adapter's effect)."""
    from megamoe.lora import load_adapter_state_dict, lora_parameters
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.parallel.sharding import full_shape

    groups = groups or getattr(model, "groups", None) or ParallelGroups()
    gen = torch.Generator().manual_seed(seed)
    state = {n: torch.randn(full_shape(p, groups), generator=gen) * std for n, p in lora_parameters(model)}
    load_adapter_state_dict(model, state, groups)


def build_lora_model(cfg, groups=None, *, sp: bool = False, seed: int = 0, fp8: str | None = None, **lora):
    """A LanguageModel with weights from ``seed`` (GEMMs in ``fp8``'s recipe), adapters applied
    and randomized."""
    from megamoe.lora import LoRAConfig, apply_lora
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize

    model = LanguageModel(cfg, groups, sequence_parallel=sp, fp8=fp8)
    initialize(model, model.groups, seed)
    apply_lora(model, LoRAConfig(**{"rank": 4, "alpha": 8.0, **lora}), seed=seed)
    randomize_adapters(model)
    return model


def token_batches(n: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(n)]


def num_full(p, groups) -> int:
    from megamoe.parallel.sharding import full_shape

    return math.prod(full_shape(p, groups))
