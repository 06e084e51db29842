"""Generation with a context-parallel prefill (gloo): every mixer letter's model prefills its
prompts split over CP=2 (alone, with TP=2, with PP=2), leaves the whole prompt's state in each
rank's cache, and decodes without CP: the prompt's last logits and every decode step's logits
equal the single-process run's (fp32, 1e-5 relative), with the contiguous and the paged cache,
and the greedy tokens are the same. Bad input: left-padded prompts under CP are one line."""
from __future__ import annotations

import functools

import pytest
import torch

from tests.mixer_utils import tiny_model
from tests.numerics import rel_err

LAYOUT = "AdSdLdMdDdIdGdKd"  # every mixer letter
PROMPTS = [[5, 9, 13, 2, 40, 7, 3, 8, 21, 33, 17, 4], [11, 4, 6, 50, 3, 9, 12, 30, 31, 32, 33, 34]]  # 12 = 3 * 2 * CP
STEPS = 5


def build(groups=None, stage=None):
    from megamoe.model.build import build_model
    from megamoe.parallel.groups import ParallelGroups
    from megamoe.model.weights import initialize

    cfg = tiny_model(LAYOUT)
    cut = {}
    if stage is not None:
        rank, pp = stage
        cut = dict(layer_ids=cfg.parsed_layout().stages(pp, balanced=True)[rank], pre_process=rank == 0,
                   post_process=rank == pp - 1)
    model = build_model(cfg, groups, **cut).eval()
    initialize(model, groups or ParallelGroups(), seed=0)
    return model


@torch.no_grad()
def decode_logits(forward, cache, steps: int = STEPS) -> torch.Tensor:
    """[steps + 1, b, V]: the prompt's last logits, then greedy steps."""
    from megamoe.inference.generate import prefill

    out = [prefill(forward, torch.tensor(PROMPTS), cache, None)]
    for _ in range(steps):
        out.append(forward(out[-1].argmax(-1, keepdim=True), cache=cache)[:, -1].float())
    return torch.stack(out)


def decode_at(layout: dict) -> dict:
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.core.config import ParallelConfig
    from megamoe.inference.generate import generate_batch
    from megamoe.layers.cache.paged import PagedCache
    from megamoe.inference.distributed import StageForward, inference_groups

    parallel = ParallelConfig(**layout)
    groups = inference_groups(parallel)
    model = build(groups, (groups.rank("pp"), parallel.pp) if parallel.pp > 1 else None)
    forward = StageForward(model, groups)
    return {"contiguous": decode_logits(forward, InferenceCache(len(PROMPTS))),
            "paged": decode_logits(forward, PagedCache(len(PROMPTS), block_size=4)),
            "greedy": generate_batch(model, PROMPTS, STEPS, forward=forward,
                                     cache_factory=functools.partial(PagedCache, block_size=4))}


@pytest.mark.parametrize("n,layout", [(2, dict(cp=2)), (4, dict(cp=2, tp=2)), (4, dict(cp=2, pp=2))],
                         ids=["cp2", "cp2-tp2", "cp2-pp2"])
def test_cp_prefill_decodes_the_single_process_logits(pool, n, layout):
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.inference.generate import generate_batch

    single = build()
    want = decode_logits(single, InferenceCache(len(PROMPTS)))
    tokens = generate_batch(single, PROMPTS, STEPS)
    for rank, got in enumerate(pool(n).run(decode_at, layout)):
        for kind in ("contiguous", "paged"):
            err = rel_err(got[kind], want)
            assert err <= 1e-5, f"rank {rank}, {kind} cache: logits relative error {err:.2e}"
        assert got["greedy"] == tokens, f"rank {rank}"


def padded_prefill(_):
    from megamoe.core.config import ParallelConfig
    from megamoe.core.errors import ConfigError
    from megamoe.inference.generate import generate_batch
    from megamoe.inference.distributed import StageForward, inference_groups

    groups = inference_groups(ParallelConfig(cp=2))
    model = build(groups)
    try:
        generate_batch(model, [[5, 9, 13, 2], [11, 4]], 2, forward=StageForward(model, groups))
    except ConfigError as e:
        return str(e)
    return None


def test_left_padded_prompts_under_cp_are_one_line(pool):
    for message in pool(2).run(padded_prefill, None):
        assert message is not None and "parallel.cp=2" in message and "equal length" in message
        assert "\n" not in message
