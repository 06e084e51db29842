"""Training the DSA indexer (train.indexer, DeepSeek-V3.2's two stages): the KL loss equals a hand
computation (dense warm-up and sparse, D and GLM-5's pooled I), trains the indexer only, falls
during a 50-step warm-up with the rest frozen, and is the same at TP=2 and CP=2 as in one process."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megamoe.core.config import ParallelConfig
from megamoe.layers.mixers.dsa import indices_to_mask
from megamoe.layers.rotary import cached_yarn_cos_sin
from megamoe.layers.spec import ForwardInfo
from tests.mixer_utils import build_mixer, randomize, tiny_model

REL = 1e-5


def mixer_of(letter: str, mode: str):
    cfg = tiny_model(f"{letter}d", norm_zero_centered=False, norm_eps=1e-6)
    mixer = build_mixer(letter, cfg)
    randomize(mixer, seed=5, std=0.4)  # spread scores: a KL of order 1, not a near-uniform 1e-4 that fp32 rounding blurs
    mixer.objective.mode, mixer.objective.scale = mode, 1.0
    return mixer.train()


def forward(mixer, x):
    info = ForwardInfo(positions=torch.arange(x.size(1))[None].expand(x.size(0), -1))
    return mixer(x, info), info


def attention_probs(mixer, x, info, allowed):
    """Each head's softmax over the allowed keys, from the expanded keys (not the absorbed form
    the layer uses), averaged over heads: [b, s, T]."""
    q_nope, q_rope, _, c, k_rope = mixer.project(x, info)
    k, _ = mixer.expand(c, k_rope)
    q = torch.cat([q_nope, q_rope], dim=-1)
    scores = torch.einsum("bshd,bthd->bhst", q, k) * mixer.scale
    p = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    return p.mean(dim=1)


def cos_sin_of(mixer, info):
    """The RoPE tables the layer hands its indexer (D), or None (I)."""
    return cached_yarn_cos_sin(info, mixer.dr, mixer.theta, mixer.yarn) if mixer.indexer.rope_dim else None


def index_scores(mixer, x, info):
    """score[b, s, t] = sum_h w_h relu(q_h . k_t / sqrt(d)) by loops over heads (with gradient)."""
    ix = mixer.indexer
    q, k, gate, w = ix.project(x, mixer.project(x, info)[2], cos_sin_of(mixer, info))
    per_head = [w[..., h, None] * torch.relu(torch.einsum("bsd,btd->bst", q[:, :, h], k) / ix.dim ** 0.5)
                for h in range(ix.heads)]
    return sum(per_head), k, gate, q, w


def kl_by_hand(p, scores, keep):
    """sum over queries of KL(p || softmax(scores)) with both restricted to ``keep`` [b, s, N]."""
    total = 0.0
    for b in range(p.size(0)):
        for s in range(p.size(1)):
            sel = keep[b, s].nonzero().flatten()
            if sel.numel() == 0:
                continue
            pt = p[b, s, sel] / p[b, s, sel].sum()
            qt = torch.softmax(scores[b, s, sel], dim=0)
            total = total + (pt * (torch.log(pt) - torch.log(qt))).sum()
    return total


@pytest.mark.parametrize("mode", ["warmup", "sparse"])
@pytest.mark.parametrize("letter", ["D", "I"])
def test_kl_equals_hand_computation_and_trains_the_indexer_only(letter, mode):
    torch.manual_seed(0)
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    mixer = mixer_of(letter, mode)
    out, info = forward(mixer, x)
    got = mixer.objective.stats["kl_sum"].item()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * g).sum().backward()
    t = x.size(1)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    ix = mixer.indexer
    with torch.no_grad():  # the layer's selection (checked against a brute-force top-k in test_dsa.py)
        chosen = indices_to_mask(ix(x, mixer.project(x, info)[2], cos_sin_of(mixer, info), None), t)
    with torch.no_grad():  # the target: the attention the layer ran (all causal keys, or its selection)
        p = attention_probs(mixer, x, info, causal if mode == "warmup" else chosen)
    scores, k, gate, q, w = index_scores(mixer, x, info)
    if letter == "D":
        keep = causal if mode == "warmup" else chosen & causal
        want = kl_by_hand(p, scores, keep)
    else:  # pools of 2: a pool's target is its tokens' mass; candidates: complete, visible pools
        kp = ix.kpool
        table = ix.pool_table(k, gate)
        first = table.first
        pool_scores = ix.score(q, table.keys, w)
        p_pool = p[..., first] + p[..., first + 1]
        visible = (first[None, :] + kp - 1 <= torch.arange(t)[:, None])[None].expand(2, -1, -1)
        keep = visible if mode == "warmup" else visible & chosen[..., first]
        want = kl_by_hand(p_pool, pool_scores, keep)
    assert abs(got - want.item()) <= REL * abs(want.item()), (got, want.item())
    assert want.item() > 0.5  # a real divergence, not an empty set
    # the KL trains the indexer, exactly; the language-model gradient never reaches it, and the
    # KL never reaches the rest (x and the attention weights get the plain layer's gradients)
    names = [n for n, _ in mixer.indexer.named_parameters()]
    hand = torch.autograd.grad(want, [dict(mixer.indexer.named_parameters())[n] for n in names], allow_unused=True)
    for n, h in zip(names, hand):
        a = dict(mixer.indexer.named_parameters())[n].grad
        if h is None:
            assert a is None or a.abs().max() == 0, n
        else:
            assert (a - h).abs().max() <= REL * h.abs().max() + 1e-12, n
    plain = mixer_of(letter, "off")
    plain.load_state_dict(mixer.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    if mode == "warmup":
        out2 = plain.attend_dense(x2, info, *[plain.project(x2, info)[i] for i in (0, 1, 3, 4)])
    else:
        out2 = forward(plain, x2)[0]
    assert (out2 - out).abs().max() <= 1e-6
    (out2 * g).sum().backward()
    assert (x2.grad - x.grad).abs().max() <= 1e-6 * x.grad.abs().max()
    for (n, a), b in zip(mixer.named_parameters(), plain.parameters()):
        if not n.startswith("indexer."):
            assert b.grad is None and a.grad is None or (a.grad - b.grad).abs().max() <= 1e-6 * b.grad.abs().max(), n


# ---- in the trainer ---------------------------------------------------------------------------------

def dsa_recipe(parallel: ParallelConfig, mode: str, steps: int, lr: float = 1e-3):
    """A tiny D/R/I stack with dense MLPs on synthetic data; every step logged (the KL per step)."""
    from megamoe.data import DataConfig
    from megamoe.training.config import (CheckpointConfig, IndexerTrainConfig, LoggingConfig, OptimConfig,
                                         TrainConfig)
    from megamoe.recipe import Recipe as TrainRecipe

    # init_std 0.3: peaked attention and index scores from the start (at 0.02 both are near uniform and
    # their KL, ~1e-5, is mostly fp32 rounding)
    model = tiny_model("DdRdId", norm_zero_centered=False, init_std=0.3)
    model.mla = dataclasses.replace(model.mla, yarn=dataclasses.replace(model.mla.yarn, factor=1.0))
    return TrainRecipe(model=model, parallel=parallel, data=DataConfig(kind="synthetic", seq_len=16, seed=2),
                       train=TrainConfig(steps=steps, micro_batch_size=2, global_batch_size=4, seed=3,
                                         indexer=IndexerTrainConfig(mode=mode)),
                       optim=OptimConfig(lr=lr, min_lr=lr / 10, warmup_steps=2, clip_grad=1.0, weight_decay=0.0),
                       checkpoint=CheckpointConfig(), logging=LoggingConfig(progress=False, latency_interval=0))


def train_case(parallel: ParallelConfig, mode: str, steps: int, log_dir: str, lr: float = 1e-3) -> dict:
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.training.trainer import Trainer

    recipe = dsa_recipe(parallel, mode, steps, lr)
    trainer = Trainer(recipe, SyntheticDataset(61, 16, seed=2))
    before = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
    history = trainer.fit(log_dir)
    moved = sorted({n.split(".indexer.")[0] + (".indexer" if ".indexer." in n else "")
                    for c in trainer.chunks for n, p in c.named_parameters() if not torch.equal(p, before[n])})
    # the indexer KL is reported on rank 0 (every step is a logging step here)
    return {"loss": [h["loss"] for h in history], "kl": [h.get("indexer_kl") for h in history], "moved": moved}


def test_warmup_kl_falls_over_50_steps_with_the_rest_frozen(pool, tmp_path):
    out = pool(1).run(train_case, ParallelConfig(), "warmup", 50, str(tmp_path), 1e-2)[0]
    kl = out["kl"]
    assert len(kl) == 50 and all(math.isfinite(v) for v in kl) and kl[0] > 0.1, kl[:3]
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert last < 0.5 * first, (first, last, kl)
    # only the D and I layers' indexers moved (R has none); the LM loss is the frozen model's
    assert out["moved"] == ["layers.0.mixer.indexer", "layers.2.mixer.indexer"], out["moved"]


@pytest.fixture(scope="module")
def single_runs(pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa")
    return {mode: pool(1).run(train_case, ParallelConfig(), mode, 3, str(root / mode))[0]
            for mode in ("warmup", "sparse")}


@pytest.mark.parametrize("name,parallel", [("tp2", ParallelConfig(tp=2, sequence_parallel=True)),
                                           ("cp2", ParallelConfig(cp=2))])
def test_indexer_training_at_tp2_and_cp2_equals_one_process(pool, single_runs, name, parallel, tmp_path):
    for mode in ("warmup", "sparse"):
        runs = pool(2).run(train_case, parallel, mode, 3, str(tmp_path / mode))
        want = single_runs[mode]
        assert runs[0]["loss"] == runs[1]["loss"] and runs[0]["moved"] == want["moved"]
        for key in ("loss", "kl"):
            diff = max(abs(a - b) / abs(b) for a, b in zip(runs[0][key], want[key]))
            assert diff <= REL, f"{name} {mode} {key}: {runs[0][key]} vs one process {want[key]}"
    assert len(want["moved"]) > 2  # sparse training moves the whole model


def test_indexer_config_errors_are_one_line():
    from megamoe.core.errors import ConfigError
    from megamoe.recipe import load_recipe

    for overrides, message in ((["train.indexer.mode=dense"], "train.indexer.mode='dense' is invalid: allowed: "
                                                               "warmup, sparse"),
                               (["train.indexer.mode=warmup"], "train.indexer.mode='warmup' is invalid: model.layout"),
                               (["train.indexer.loss_coeff=0"], "train.indexer.loss_coeff=0.0 is invalid: must be > 0")):
        with pytest.raises(ConfigError) as e:
            load_recipe("tiny_train", overrides).validate()
        assert str(e.value).startswith(message), str(e.value)
