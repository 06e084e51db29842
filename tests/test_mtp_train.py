"""The multi-token-prediction loss (``train.mtp_loss_weight``, DeepSeek-V3's definition) trained:
equal to a hand computation (value and every gradient), the same at TP=2 (with SP) and PP=2 as
in one process, and frozen or adapted under LoRA."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megamoe.core.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig, MTPConfig, ParallelConfig
from megamoe.parallel.cross_entropy import IGNORE_INDEX

WEIGHT = 0.3


def mtp_model_config(depths: int = 2) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, layout="AdAe",
                       attention=AttentionConfig(num_heads=4, num_kv_heads=2, qk_norm=True),
                       mlp=MLPConfig(ffn_hidden_size=48),
                       moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, num_shared_experts=1),
                       mtp=MTPConfig(num_layers=depths, layout="Ae"), backend="local")


def rms(x: torch.Tensor, norm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def hand_loss(model, ids, labels, documents) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Main cross-entropy + lambda * mean over depths of each depth's, written out: depth k reads
    the token k+1 ahead and predicts the one k+2 ahead, targets across documents ignored."""
    from megamoe.layers.spec import ForwardInfo

    b, s = ids.shape
    pos = torch.arange(s).expand(b, -1)
    h = model.final_norm(model.run_layers(model.embedding(ids), ForwardInfo(positions=pos, documents=documents)))
    w_out = model.output_layer.weight
    main = F.cross_entropy((h @ w_out.T).reshape(-1, 64), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    per_depth = []
    for k, depth in enumerate(model.mtp):
        ahead = torch.zeros_like(ids)
        target = torch.full_like(labels, IGNORE_INDEX)
        for i in range(s - k - 1):
            ahead[:, i] = ids[:, i + k + 1]
            same_doc = documents[:, i] == documents[:, i + k + 1]
            target[:, i] = torch.where(same_doc, labels[:, i + k + 1], IGNORE_INDEX)
        x = torch.cat([rms(model.embedding.weight[ahead], depth.enorm), rms(h, depth.hnorm)], -1) @ depth.eh_proj.weight.T
        h = rms(depth.layer(x, ForwardInfo(positions=pos + k + 1, documents=documents)), depth.final_norm)
        per_depth.append(F.cross_entropy((h @ w_out.T).reshape(-1, 64), target.reshape(-1), ignore_index=IGNORE_INDEX))
    return main + WEIGHT * sum(per_depth) / len(per_depth), per_depth


def test_mtp_loss_equals_a_hand_computation():
    from megamoe.model.build import build_model
    from megamoe.model.language_model import shift_labels
    from megamoe.model.mtp import MTPTargets, depth_scales, target_counts
    from megamoe.model.weights import initialize

    model = build_model(mtp_model_config())
    initialize(model, model.groups, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 11), generator=gen)
    labels = shift_labels(ids)
    labels[0, 3] = IGNORE_INDEX  # a masked target (SFT prompt)
    documents = torch.tensor([[0] * 6 + [1] * 5, [0] * 11])  # two packed documents in row 0

    want, per_depth = hand_loss(model, ids, labels, documents)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    counts = target_counts(labels, 2, documents)
    assert counts == [int((t != IGNORE_INDEX).sum()) for t in _targets(labels, documents)]
    logits = model.forward_stage(ids, documents=documents, mtp=MTPTargets(ids, labels, depth_scales(WEIGHT, counts)))
    main_sum = model.loss_sum(logits, labels)
    (main_sum / int((labels != IGNORE_INDEX).sum())).backward()
    got = [s / c for s, c in zip(model.mtp_loss_sums.tolist(), counts)]
    assert max(abs(g - w.item()) for g, w in zip(got, per_depth)) <= 1e-6
    assert set(want_grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith("mtp.1.") for n in want_grads)  # the deepest depth trains too
    for name, g in want_grads.items():
        err = (model.get_parameter(name).grad - g).abs().max().item()
        assert err <= 1e-6 * max(1.0, g.abs().max().item()), (name, err)


def _targets(labels, documents):
    """The two depths' targets, by hand as in hand_loss."""
    out = []
    for k in range(2):
        t = torch.full_like(labels, IGNORE_INDEX)
        for i in range(labels.size(1) - k - 1):
            t[:, i] = torch.where(documents[:, i] == documents[:, i + k + 1], labels[:, i + k + 1], IGNORE_INDEX)
        out.append(t)
    return out


# ---- the trainer at parallel layouts -------------------------------------------------------------

STEPS = 6


def mtp_recipe(parallel: ParallelConfig, **train):
    from tests.test_trainer_parity import tiny_recipe

    recipe = tiny_recipe(parallel, steps=STEPS, mtp_loss_weight=WEIGHT, **train)
    return dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, mtp=MTPConfig(num_layers=2, layout="Ae")))


def run_mtp_recipe(recipe, log_dir: str) -> list[tuple[float, float]]:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer

    trainer = Trainer(recipe, SyntheticDataset(recipe.model.vocab_size, recipe.data.seq_len, seed=recipe.data.seed))
    return [(h["loss"], h["mtp_loss"]) for h in trainer.fit(log_dir)]


@pytest.fixture(scope="module")
def mtp_reference(pool, tmp_path_factory):
    return pool(1).run(run_mtp_recipe, mtp_recipe(ParallelConfig()), str(tmp_path_factory.mktemp("ref")))[0]


@pytest.mark.parametrize("name, parallel", [("tp2-sp", ParallelConfig(tp=2, sequence_parallel=True)),
                                            ("pp2", ParallelConfig(pp=2))])
def test_mtp_training_at_tp2_and_pp2_matches_one_process(pool, mtp_reference, name, parallel, tmp_path):
    curves = pool(2).run(run_mtp_recipe, mtp_recipe(parallel), str(tmp_path))
    assert curves[0] == curves[1]  # every rank reports the same losses
    assert len(curves[0]) == len(mtp_reference) == STEPS
    diff = max(abs(a - b) for got, want in zip(curves[0], mtp_reference) for a, b in zip(got, want))
    assert diff <= 1e-5, f"{name}: (loss, mtp_loss) differ from one process by {diff:.2e}"
    assert mtp_reference[-1][1] < mtp_reference[0][1]  # the MTP depths learn


def test_lora_adapts_or_freezes_the_mtp_depths(pool, tmp_path):
    """Under LoRA the MTP base is frozen; its adapters train with the MTP loss, and with
    mtp_loss_weight 0 they are frozen too (no MTP forward in training)."""
    from megamoe.lora import LoRAConfig

    for weight in (WEIGHT, 0.0):
        recipe = dataclasses.replace(mtp_recipe(ParallelConfig()), lora=LoRAConfig(rank=2, targets=["*"]))
        recipe.train.steps, recipe.train.mtp_loss_weight = 2, weight
        trained = pool(1).run(_lora_case, recipe, str(tmp_path / str(weight)))[0]
        assert trained["base"] == [] and trained["adapters"], trained
        assert all(n.startswith("mtp.") for n in trained["mtp_adapters"]) and \
            bool(trained["mtp_adapters"]) == (weight > 0), trained


def _lora_case(recipe, log_dir: str) -> dict:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.lora import is_adapter_name
    from megamoe.training.trainer import Trainer

    trainer = Trainer(recipe, SyntheticDataset(recipe.model.vocab_size, recipe.data.seq_len, seed=recipe.data.seed))
    before = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
    history = trainer.fit(log_dir)
    changed = [n for c in trainer.chunks for n, p in c.named_parameters() if not torch.equal(p, before[n])]
    return {"base": [n for n in changed if not is_adapter_name(n)],
            "adapters": [n for n in changed if is_adapter_name(n)],
            "mtp_adapters": [n for n in changed if is_adapter_name(n) and n.startswith("mtp.")],
            "mtp_loss": [h.get("mtp_loss") for h in history]}


def test_plan_puts_the_mtp_depths_and_an_embedding_copy_on_the_last_stage():
    """megamoe-plan's memory per stage: at PP=2 the last stage holds the depths' parameters and a
    copy of the embedding; with the MTP loss on, it keeps their activations too."""
    from megamoe.model.params import count_parameters
    from megamoe.planning.plan import meta_model, stage_memory

    cfg = dataclasses.replace(mtp_model_config(), layout="Ad|Ae")
    plain = dataclasses.replace(cfg, mtp=None)
    parallel = ParallelConfig(pp=2)
    budget = count_parameters(meta_model(cfg))
    depths = sum(t for part, (t, _) in budget.parts.items() if part.startswith("mtp."))
    rows, rows_plain = stage_memory(cfg, parallel, 2, 1, 16), stage_memory(plain, parallel, 2, 1, 16)
    assert rows[0]["params"] == rows_plain[0]["params"]
    assert rows[1]["params"] - rows_plain[1]["params"] == depths + cfg.vocab_size * cfg.hidden_size
    trained = stage_memory(cfg, parallel, 2, 1, 16, mtp=True)
    assert trained[1]["activations"] > rows[1]["activations"] == rows_plain[1]["activations"]
