"""TP=2 (with and without sequence parallelism) equals TP=1: logits, loss, every gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.core.config import AttentionConfig, MLPConfig, ModelConfig, ParallelConfig
from tests.numerics import rel_err

REL = 1e-5


def tiny_dense(**kw) -> ModelConfig:
    base = dict(vocab_size=101, hidden_size=64, layout="AdSdAd",
                attention=AttentionConfig(num_heads=4, num_kv_heads=2, qk_norm=True, output_gate=True,
                                          partial_rotary_factor=0.5, sliding_window=5),
                mlp=MLPConfig(ffn_hidden_size=96), norm_zero_centered=True)
    base.update(kw)
    return ModelConfig(**base)


def fp32_noise_floor(model, ids, labels) -> dict:
    """Per-parameter relative error of the fp32 gradient against the same model in float64: the
    rounding a layout-independent fp32 gradient already carries. Some gradients (GLM-5's
    hyper-connection scales: sums over every token of products through the Sinkhorn mix) carry
    about 1e-5 of it even on one process, so two fp32 layouts can differ by that much."""
    import copy

    ref64 = copy.deepcopy(model).double()
    ref64.zero_grad()
    ref64(ids, labels=labels).backward()
    ref64 = dict(ref64.named_parameters())
    return {f"floor {n}": rel_err(p.grad, ref64[n].grad) for n, p in model.named_parameters() if p.grad is not None}


def tp_parity_case(cfg: ModelConfig, tp: int, sp: bool, seed: int = 0, floor: bool = False) -> dict:
    """Relative errors of TP (+SP) against one process: logits, loss, each gathered gradient; with
    ``floor`` also each gradient's fp32 noise floor (``fp32_noise_floor``)."""
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.parallel.groups import ParallelGroups, build_groups
    from megamoe.model.weights import finalize_grads, initialize
    from tests.mixer_utils import param_grad_errors

    groups = build_groups(ParallelConfig(tp=tp, sequence_parallel=sp))
    ref = LanguageModel(cfg)
    initialize(ref, ParallelGroups(), seed)
    model = LanguageModel(cfg, groups, sequence_parallel=sp)
    initialize(model, groups, seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
    labels = shift_labels(ids)
    errs = {"logits": rel_err(model(ids), ref(ids))}
    loss, ref_loss = model(ids, labels=labels), ref(ids, labels=labels)
    errs["loss"] = rel_err(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    finalize_grads(model, groups)
    param_grad_errors(ref, model, groups, errs)
    if floor:
        errs.update(fp32_noise_floor(ref, ids, labels))
    return errs


def over_tolerance(errs: dict, rel: float) -> dict:
    """Errors over ``rel``, or over 3x the gradient's fp32 noise floor where that was measured and is larger."""
    bound = lambda k: max(rel, 3 * errs.get("floor " + k.removeprefix("grad "), 0.0))  # noqa: E731
    return {k: v for k, v in errs.items() if not k.startswith("floor ") and v > bound(k)}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp2_equals_tp1(pool, sp, tied):
    results = pool(2).run(tp_parity_case, tiny_dense(tie_embeddings=tied), 2, sp)
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if v > REL}
        assert not bad, f"rank {rank}: relative errors over {REL}: {bad}"
    assert len(results[0]) > 10  # every gradient was compared


def vocab_ce_case(vocab: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict:
    from megamoe.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megamoe.parallel.groups import build_groups

    groups = build_groups(ParallelConfig(tp=2))
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(3, 7, vocab, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, vocab, (3, 7), generator=gen)
    labels[0, :3] = -100
    labels[1, 2] = vocab - 1  # the last real entry, next to the padding
    padded = -(-vocab // 2) * 2
    full_pad = torch.cat([full, full.new_zeros(3, 7, padded - vocab)], -1)
    local = full_pad.chunk(2, -1)[groups.tp_rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, groups.tp, vocab)
    ref_in = full.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    w = torch.randn(3, 7, generator=gen, dtype=torch.float64).to(dtype)
    (loss * w).sum().backward()
    (ref * w).sum().backward()
    ref_grad_local = torch.cat([ref_in.grad, ref_in.grad.new_zeros(3, 7, padded - vocab)], -1)
    ref_grad_local = ref_grad_local.chunk(2, -1)[groups.tp_rank]
    return {"loss": rel_err(loss, ref), "grad": rel_err(local.grad, ref_grad_local),
            "ignored_zero": float(loss[0, :3].abs().max())}


@pytest.mark.parametrize("vocab", [64, 37])
@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-12), (torch.float32, REL)], ids=["fp64", "fp32"])
def test_vocab_parallel_cross_entropy(pool, vocab, dtype, rel):
    """Loss and logit gradient at TP=2 (padding past the vocabulary, ignored labels) against
    torch's cross-entropy on the full logits: exact in fp64, rel <= 1e-5 in fp32."""
    for errs in pool(2).run(vocab_ce_case, vocab, 0, dtype):
        assert errs["loss"] <= rel and errs["grad"] <= rel, errs
        assert errs["ignored_zero"] == 0.0
