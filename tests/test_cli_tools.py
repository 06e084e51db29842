"""The command lines users run, as subprocesses: conversion both ways, verification (and its
exit status), generation (greedy and sampled), the pretraining script's dry run; and the
sampling rules of ``megamoe.inference.generate``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist import side_by_side

REPO = Path(__file__).resolve().parent.parent


def run(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    out = subprocess.run(list(args), cwd=REPO, capture_output=True, text=True, env=full_env, timeout=300)
    if check and out.returncode:
        raise AssertionError(f"{args} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out


def tool(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(sys.executable, str(REPO / "tools" / name), *args, check=check)


def tools(*calls: tuple[str, ...], env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """``run(*call)`` for each call, side by side (``check=False``: the caller reads each status)."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return side_by_side([list(c) for c in calls], [full_env] * len(calls), cwd=REPO)


def test_convert_verify_generate_command_lines(tmp_path):
    """import-hf -> export-hf -> verify (exit 0, and 1 when the tolerance cannot be met) ->
    generate: greedy equals the Python function, sampling is reproducible from its seed."""
    from megamoe.convert import from_hf
    from megamoe.inference.generate import generate, generate_batch
    from tests.test_convert_qwen import tiny_qwen3_moe

    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    tiny_qwen3_moe().save_pretrained(hf_dir)
    assert "wrote megamoe checkpoint" in tool("convert.py", "import-hf", str(hf_dir), str(ckpt)).stdout
    tool("convert.py", "export-hf", str(ckpt), str(back))
    assert (back / "config.json").exists() and list(back.glob("*.safetensors"))
    ids = [3, 17, 42, 5]
    py = (sys.executable,)
    sample = (*py, REPO / "tools/generate.py", back, "--ids", "3,17", "--max-new-tokens", "8", "--sample", "--top-k",
              "20", "--seed", "1")
    # the runs below only read `back`: side by side
    ok, strict, greedy, batch, sampled, again = tools(
        (*py, REPO / "tools/verify.py", back),
        (*py, REPO / "tools/verify.py", back, "--atol", "0"),  # fp32 rounding is above 0
        (*py, REPO / "tools/generate.py", back, "--ids", ",".join(map(str, ids)), "--max-new-tokens", "6"),
        (*py, REPO / "tools/generate.py", back, "--ids", "3,17,42,5", "--ids", "9", "--max-new-tokens", "4",
         "--stream", "--prefill-chunk", "2", "--kv-cache", "paged", "--block-size", "2"),
        sample, sample)
    for out in (ok, greedy, batch, sampled, again):
        assert out.returncode == 0, (out.args, out.stderr[-2000:])
    assert ok.stdout.strip().endswith("OK")
    assert strict.returncode == 1 and strict.stdout.strip().endswith("MISMATCH")

    want = generate(from_hf(back), torch.tensor([ids]), 6)[0, len(ids):].tolist()
    assert greedy.stdout.strip().splitlines()[-1] == str(want)  # without a tokenizer it prints the ids
    batch = batch.stdout.strip().splitlines()
    want = generate_batch(from_hf(back), [[3, 17, 42, 5], [9]], 4)
    assert batch[-2:] == [str(w) for w in want] and len(batch) == 2 + 8  # 8 streamed "[row] token" lines
    assert batch[:2] == [f"[0] {want[0][0]}", f"[1] {want[1][0]}"]
    assert sampled.stdout == again.stdout


def test_pretrain_script_dry_run_prints_the_plan_and_command():
    env = {"DRY_RUN": "1", "NGPU": "8", "NNODES": "128", "TP": "8", "PP": "4", "EP": "32", "CONFIG": "moe_1t"}
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    runs = side_by_side([["bash", "pretrain_scripts/pretrain_hybrid_moe.sh"]] * 2,
                        [{**full_env, **env}, {**full_env, "DRY_RUN": "1"}], cwd=REPO)
    for r in runs:
        assert r.returncode == 0, f"{r.args} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    out, default = (r.stdout for r in runs)
    assert "command: torchrun --nnodes 128 --nproc-per-node 8" in out
    assert "parallel.tp=8 parallel.pp=4 parallel.ep=32" in out
    assert "1.03T" in out  # the plan's parameter budget
    assert "--config tiny_hybrid_moe" in default  # the script's default recipe exists and plans


# ---- sampling rules ------------------------------------------------------------------------

def test_sampling_rules():
    from megamoe.inference.generate import pick

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(4000, 1)
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    greedy = pick(logits, do_sample=False, temperature=1.0, top_k=0, top_p=1.0, generator=None)
    assert (greedy == 0).all()
    top1 = pick(logits, do_sample=True, temperature=1.0, top_k=1, top_p=1.0, generator=gen(0))
    assert (top1 == 0).all()
    cold = pick(logits, do_sample=True, temperature=1e-4, top_k=0, top_p=1.0, generator=gen(0))
    assert (cold == 0).all()
    top2 = pick(logits, do_sample=True, temperature=1.0, top_k=2, top_p=1.0, generator=gen(1))
    assert set(top2.tolist()) == {0, 1}
    # nucleus: softmax is about [.61, .22, .14, .03, .004]; top_p 0.7 keeps the first two
    nucleus = pick(logits, do_sample=True, temperature=1.0, top_k=0, top_p=0.7, generator=gen(2))
    assert set(nucleus.tolist()) == {0, 1}
    free = pick(logits, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, generator=gen(3))
    freq = torch.bincount(free, minlength=5).float() / free.numel()
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.03)
    again = pick(logits, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, generator=gen(3))
    assert torch.equal(free, again)


@pytest.mark.parametrize("layout", ["GdAd", "MeAe"])
def test_sampled_generation_is_seeded_and_top_k_1_is_greedy(layout):
    from megamoe.core.config import MoEConfig
    from megamoe.inference.generate import generate
    from megamoe.model.language_model import LanguageModel
    from megamoe.model.weights import initialize
    from tests.mixer_utils import tiny_model

    cfg = tiny_model(layout, moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16))
    model = LanguageModel(cfg)
    initialize(model, model.groups, seed=0)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    greedy = generate(model, ids, 8)
    assert torch.equal(generate(model, ids, 8, do_sample=True, top_k=1, seed=5), greedy)
    a = generate(model, ids, 8, do_sample=True, temperature=1.5, seed=7)
    assert torch.equal(a, generate(model, ids, 8, do_sample=True, temperature=1.5, seed=7))
    assert not torch.equal(a, generate(model, ids, 8, do_sample=True, temperature=1.5, seed=8))
