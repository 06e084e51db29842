"""Generation at training layouts (2 gloo processes): a tiny Qwen3-Next (Gated DeltaNet, gated
attention, routed experts) read from its HF folder sharded on load decodes a padded batch to the
single-process tokens at TP=2, EP=2, TP=2 x ETP=2 and PP=2, greedy and sampled, contiguous and
paged cache; verify at TP=2 matches transformers; the commands with layout flags."""
from __future__ import annotations

import functools

import pytest
import torch

PROMPTS = [[5, 9, 13, 2, 40, 7, 3], [11, 4], [30, 31, 32, 33, 34]]
LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2), "tp2-etp2": dict(tp=2, etp=2), "pp2": dict(pp=2)}
SAMPLE = dict(do_sample=True, top_k=20, seed=3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.test_convert_qwen import tiny_qwen3_next

    path = tmp_path_factory.mktemp("qwen3_next") / "hf"
    tiny_qwen3_next().save_pretrained(path)
    return str(path)


def decode_at(hf_dir: str, layout: dict) -> dict:
    """On every rank: this rank's stage and shards, the batch decoded three ways."""
    from megamoe.core.config import ParallelConfig
    from megamoe.inference.generate import generate_batch
    from megamoe.layers.cache.paged import PagedCache
    from megamoe.inference.distributed import StageForward, inference_groups
    from megamoe.inference.load import load_model

    parallel = ParallelConfig(**layout)
    groups = inference_groups(parallel)
    model = load_model(hf_dir, groups=groups)
    forward = StageForward(model, groups)
    held = sum(p.numel() for p in model.parameters())
    return {"greedy": generate_batch(model, PROMPTS, 6, forward=forward),
            "sampled": generate_batch(model, PROMPTS, 6, forward=forward, **SAMPLE),
            "paged": generate_batch(model, PROMPTS, 6, forward=forward,
                                    cache_factory=functools.partial(PagedCache, block_size=2)),
            "params": held}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_generation_equals_single_process(pool, hf_dir, layout):
    from megamoe.convert import from_hf
    from megamoe.inference.generate import generate_batch

    single = from_hf(hf_dir)
    want = {"greedy": generate_batch(single, PROMPTS, 6), "sampled": generate_batch(single, PROMPTS, 6, **SAMPLE)}
    results = pool(2).run(decode_at, hf_dir, LAYOUTS[layout])
    total = sum(p.numel() for p in single.parameters())
    for rank in results:
        assert rank["greedy"] == want["greedy"] and rank["paged"] == want["greedy"]
        assert rank["sampled"] == want["sampled"]
        assert rank["params"] < total  # each rank holds only its stage / shards


def verify_at_tp2(hf_dir: str):
    import torch.distributed as dist

    from megamoe.core.config import ParallelConfig
    from megamoe.diagnostics.verify import verify
    from megamoe.inference.distributed import StageForward, inference_groups
    from megamoe.inference.load import load_model

    parallel = ParallelConfig(tp=2)
    groups = inference_groups(parallel)
    model = load_model(hf_dir, groups=groups)
    report = verify(hf_dir, model=model, forward=StageForward(model, groups), new_tokens=8,
                    reference=dist.get_rank() == 0)
    return None if report is None else (report.max_abs_logits, report.decode_equal, report.ok)


def test_verify_at_tp2_matches_transformers(pool, hf_dir):
    results = pool(2).run(verify_at_tp2, hf_dir)
    assert results[1] is None
    max_abs, decode_equal, ok = results[0]
    assert max_abs <= 1e-4 and decode_equal and ok


def run_command(name: str, argv: list[str]) -> tuple[int, str]:
    """A command's main(argv) on this rank (the pool is what torchrun would start): exit status
    and what it printed."""
    import contextlib
    import importlib
    import io

    out, code = io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            importlib.import_module(f"megamoe.commands.{name}").main(argv)
        except SystemExit as e:
            code = e.code or 0
    return code, out.getvalue()


def test_commands_at_a_layout(pool, hf_dir):
    """The commands with layout flags on 2 ranks: verify --tp 2 exits 0 with OK (rank 0 reports,
    rank 1 prints nothing); generate --pp 2 prints, once, the single-process tokens of a
    two-prompt batch."""
    from megamoe.convert import from_hf
    from megamoe.inference.generate import generate_batch

    verify = pool(2).run(run_command, "verify", [hf_dir, "--tp", "2", "--tokens", "4"])
    assert verify[0][0] == 0 and verify[0][1].strip().endswith("OK") and verify[1] == (0, "")
    argv = [hf_dir, "--pp", "2", "--ids", "5,9,13", "--ids", "11,4", "--max-new-tokens", "4", "--kv-cache", "paged"]
    generate = pool(2).run(run_command, "generate", argv)
    want = [str(t) for t in generate_batch(from_hf(hf_dir), [[5, 9, 13], [11, 4]], 4)]
    assert generate[0] == (0, "\n".join(want) + "\n") and generate[1] == (0, "")


def test_commands_with_a_context_parallel_prefill(pool, hf_dir):
    """verify --cp 2 (its 12-token prompts split over two ranks; full logits all-gathered) matches
    transformers; generate --cp 2 prints the single-process tokens of two 12-token prompts."""
    from megamoe.convert import from_hf
    from megamoe.inference.generate import generate_batch

    verify = pool(2).run(run_command, "verify", [hf_dir, "--cp", "2", "--tokens", "4"])
    assert verify[0][0] == 0 and verify[0][1].strip().endswith("OK") and verify[1] == (0, "")
    prompts = [[5, 9, 13, 2, 40, 7, 3, 8, 21, 33, 17, 4], [11, 4, 6, 50, 3, 9, 12, 30, 31, 32, 33, 34]]
    argv = [hf_dir, "--cp", "2", *[a for p in prompts for a in ("--ids", ",".join(map(str, p)))], "--max-new-tokens", "4"]
    generate = pool(2).run(run_command, "generate", argv)
    want = [str(t) for t in generate_batch(from_hf(hf_dir), prompts, 4)]
    assert generate[0] == (0, "\n".join(want) + "\n") and generate[1] == (0, "")
