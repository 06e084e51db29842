"""DeepSeek-V4 as a training target: the released-size preset's counts (by hand, and against
transformers' DeepseekV4ForCausalLM built on meta), LoRA with the mHC weights, the hash table and the
routers frozen, and the router statistics of hash and top-k layers in TensorBoard."""
from __future__ import annotations

import pytest
import torch

from megamoe.core.config import ParallelConfig
from tests.v4_utils import randomize_v4, tiny_v4


def hand_count_v4(m) -> tuple[int, float]:
    """(total, active per token) of a V4 model config by formula (docs/mixers.md, docs/moe.md)."""
    h, c, moe, n = m.hidden_size, m.compressed, m.moe, m.hyper_connections.streams
    H, D, rq, G, ro = c.num_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank
    attn = h * rq + rq + rq * H * D + h * D + D + H + H * D * ro + G * ro * h

    def compressor(width: int, rate: int, dim: int) -> int:
        return 2 * h * width + rate * width + dim

    idx = c.indexer
    mixer = {"W": attn, "H": attn + compressor(D, c.hca_rate, D),
             "C": attn + compressor(2 * D, c.csa_rate, D) + compressor(2 * idx.head_dim, c.csa_rate, idx.head_dim)
             + rq * idx.num_heads * idx.head_dim + h * idx.num_heads}
    experts = 3 * moe.num_experts * h * moe.moe_ffn_hidden_size
    shared = 3 * h * moe.shared_ffn() + moe.num_experts * h  # the shared expert and the router
    hc = 2 * ((2 + n) * n * (n * h + 1) + 3)
    total = active = 2 * m.vocab_size * h + h + n * (n * h + 1) + 1  # embedding, output, final norm, head
    for kind in m.parsed_layout().layers:
        select = m.vocab_size * moe.top_k if kind.mlp == "h" else moe.num_experts  # hash table or bias
        layer = mixer[kind.mixer] + 2 * h + hc + shared
        total += layer + experts + select
        active += layer + experts * moe.top_k / moe.num_experts + (moe.top_k if kind.mlp == "h" else select)
    return total, active


def test_released_size_preset_counts_on_meta():
    """megamoe/recipes/deepseek_v4_pro.yaml in a fresh process on meta: its counts equal the hand
    count, and the total equals transformers' parameters plus what transformers keeps as buffers
    (the selection biases and the hash tables)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from megamoe.core.config import validate_model_parallel
    from megamoe.recipe import load_recipe
    from tests.presets import meta_budget

    out = meta_budget("deepseek_v4_pro")
    recipe = load_recipe("deepseek_v4_pro")
    validate_model_parallel(recipe.model, recipe.parallel)
    total, active = hand_count_v4(recipe.model)
    assert out["total"] == total == 1_572_975_537_379
    assert out["active"] == pytest.approx(active, rel=1e-12) and 49.7e9 < active < 49.8e9
    assert out["seconds"] < 30 and out["rss_mib"] < 2048, out
    cfg = DeepseekV4Config(vocab_size=129280, hidden_size=7168, moe_intermediate_size=3072, num_hidden_layers=61,
                           num_attention_heads=128, head_dim=512, q_lora_rank=1536, num_experts_per_tok=6,
                           n_routed_experts=384, routed_scaling_factor=2.5, o_groups=16, index_topk=512)
    with torch.device("meta"):
        hf = DeepseekV4ForCausalLM(cfg)
    buffers = 58 * 384 + 3 * 129280 * 6  # e_score_correction_bias of the top-k layers, tid2eid of the hash ones
    assert sum(p.numel() for p in hf.parameters()) + buffers == total
    assert recipe.model.parsed_layout().compact().replace("|", "") == "".join(
        {"heavily_compressed_attention": "H", "compressed_sparse_attention": "C"}[t] + ("h" if m == "hash_moe" else "e")
        for t, m in zip(cfg.layer_types, cfg.mlp_layer_types))


def test_lora_finetune_keeps_mhc_hash_table_and_routers_frozen():
    """20 LoRA steps on the tiny model (adapters on every linear role and expert): the loss falls,
    the adapters move, and the hyper-connections, the hash table, the routers, the sinks and the
    compressors' position biases stay bitwise."""
    from megamoe.lora import LoRAConfig, apply_lora
    from megamoe.model.build import build_model
    from megamoe.model.language_model import shift_labels
    from megamoe.model.weights import initialize

    model = build_model(tiny_v4())
    initialize(model, model.groups, 0)
    randomize_v4(model, 0)
    model = apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if any(k in n for k in ("_hc.", "stream_head", "router", "sinks", "position_bias"))}
    assert any("router.table" in n for n in frozen) and any("mixer_hc.fn" in n for n in frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and not any(p.requires_grad for n, p in model.named_parameters() if n in frozen)
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(20):
        loss = model(ids, labels=shift_labels(ids))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses[::5]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def monitored_v4_run(log_dir: str) -> None:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer
    from tests.test_trainer_parity import tiny_recipe

    recipe = tiny_recipe(ParallelConfig(), steps=2)
    recipe.model = tiny_v4("WhCe")
    Trainer(recipe, SyntheticDataset(64, 16, seed=3)).fit(log_dir)


def test_router_statistics_of_hash_and_topk_layers_in_tensorboard(pool, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pool(1).run(monitored_v4_run, str(tmp_path))
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for name in ("imbalance", "router_entropy"):
        per_layer = sorted(t for t in tags if t.startswith(f"moe/{name}"))
        assert len(per_layer) == 2 and all(acc.Scalars(t) for t in per_layer), (name, per_layer)  # hash, top-k
