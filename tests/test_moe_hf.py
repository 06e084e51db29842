"""The MoE layer equals transformers' MoE blocks with the same weights on random inputs:
Qwen3-Next (softmax, gated shared expert), DeepSeek-V3 and Kimi-Linear (sigmoid, group-limited
routing, e_score_correction_bias, scaling, shared experts), MiniMax (softmax, always
renormalised, no shared expert). Outputs and every gradient, fp32, rel <= 1e-5."""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import ModelConfig, MoEConfig
from tests.numerics import rel_err

REL = 1e-5
H, E, K, F_MOE = 32, 8, 2, 12


def hf_block(family: str):
    """(block, MoEConfig kwargs, prefix of the shared expert in the block) for a tiny config."""
    import transformers as tf

    common = dict(hidden_size=H, num_experts_per_tok=K, moe_intermediate_size=F_MOE, hidden_act="silu")
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block

        cfg = tf.Qwen3NextConfig(num_experts=E, shared_expert_intermediate_size=20, norm_topk_prob=True, **common)
        ours = dict(num_shared_experts=1, shared_expert_ffn_hidden_size=20, shared_expert_gate=True)
    elif family in ("deepseek_v3", "kimi_linear"):
        if family == "deepseek_v3":
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block

            cfg = tf.DeepseekV3Config(n_routed_experts=E, n_shared_experts=2, n_group=4, topk_group=2,
                                      norm_topk_prob=True, routed_scaling_factor=2.5, **common)
        else:
            from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE as Block

            cfg = tf.KimiLinearConfig(num_experts=E, num_shared_experts=2, num_expert_group=4, topk_group=2,
                                      moe_renormalize=True, routed_scaling_factor=2.5, **common)
        ours = dict(num_shared_experts=2, score_function="sigmoid", n_group=4, topk_group=2,
                    routed_scaling_factor=2.5, expert_bias=True)
    elif family == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxSparseMoeBlock as Block

        common.pop("moe_intermediate_size")
        cfg = tf.MiniMaxConfig(num_local_experts=E, intermediate_size=F_MOE, **common)
        ours = {}
    cfg._experts_implementation = "eager"
    block = Block(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, buf in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    return block, dict(num_experts=E, top_k=K, moe_ffn_hidden_size=F_MOE, **ours)


def hf_to_megamoe(block) -> dict[str, torch.Tensor]:
    """megamoe parameter name -> tensor built from the HF block's weights."""
    sd = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    out = {"router.weight": sd["gate.weight"], "experts.gate_up_weight": sd["experts.gate_up_proj"],
           "experts.down_weight": sd["experts.down_proj"]}
    if "gate.e_score_correction_bias" in sd:
        out["router.expert_bias"] = sd["gate.e_score_correction_bias"]
    for prefix in ("shared_expert", "shared_experts"):
        if f"{prefix}.gate_proj.weight" in sd:
            out["shared_experts.linear_fc1.weight"] = torch.cat([sd[f"{prefix}.gate_proj.weight"],
                                                                 sd[f"{prefix}.up_proj.weight"]])
            out["shared_experts.linear_fc2.weight"] = sd[f"{prefix}.down_proj.weight"]
    if "shared_expert_gate.weight" in sd:
        out["shared_gate"] = sd["shared_expert_gate.weight"]
    return out


def ours_from(block, moe_kw: dict):
    from megamoe.layers.mlp.moe import MoELayer
    from megamoe.model.language_model import build_context

    cfg = ModelConfig(hidden_size=H, layout="Ae", moe=MoEConfig(**moe_kw))
    layer = MoELayer(cfg.moe, build_context(cfg), 0)
    weights = hf_to_megamoe(block)
    assert set(weights) == {n for n, _ in layer.named_parameters()}, "every parameter mapped"
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(weights[name])
    return layer, weights


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3", "kimi_linear", "minimax"])
def test_matches_transformers_moe_block(family):
    block, moe_kw = hf_block(family)
    ours, hf_weights = ours_from(block, moe_kw)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, H, generator=gen)
    g = torch.randn(2, 7, H, generator=gen)
    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_hf = block(x_hf)
    y_hf = y_hf[0] if isinstance(y_hf, tuple) else y_hf
    y_ours = ours(x_ours)
    assert rel_err(y_ours, y_hf) <= REL
    (y_hf * g).sum().backward()
    (y_ours * g).sum().backward()
    assert rel_err(x_ours.grad, x_hf.grad) <= REL
    for name, p in ours.named_parameters():
        if p.requires_grad:
            if name == "shared_experts.linear_fc1.weight":  # gate|up fused from two HF linears
                prefix = "shared_expert" if family == "qwen3_next" else "shared_experts"
                ref = torch.cat([block.get_submodule(f"{prefix}.gate_proj").weight.grad,
                                 block.get_submodule(f"{prefix}.up_proj").weight.grad])
            else:
                ref = hf_weights[name].grad
            assert rel_err(p.grad, ref) <= REL, name


def test_aux_loss_matches_transformers_load_balancing_loss():
    """transformers' loss is top_k times megamoe's (which normalises the load by T * top_k, as
    Megatron does): aux_loss_coeff = router_aux_loss_coef * top_k reproduces it."""
    from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

    from megamoe.model.moe_controls import moe_metrics

    block, moe_kw = hf_block("qwen3_next")
    ours, _ = ours_from(block, dict(moe_kw, aux_loss_coeff=1.0))
    x = torch.randn(1, 9, H, generator=torch.Generator().manual_seed(2))
    ours(x)
    logits = torch.nn.functional.linear(x.reshape(-1, H), block.gate.weight)
    theirs = load_balancing_loss_func((logits,), E, K)
    assert abs(moe_metrics(ours)[0]["aux_loss"] * K - theirs.item()) <= 1e-5 * theirs.item()
