"""What the benchmarks in tools/ share: the peer model's configuration and the machine's speed.

``QWEN3_NEXT_PEER`` is the ``transformers`` Qwen3-Next the training-step and decoding
benchmarks compare against (docs/performance.md, "Peer configurations"); ``matmul_rate`` is
the fp32 GEMM rate every CPU benchmark prints beside its ratios (machines differ about 2x);
``alternating`` times contenders in turns and ``report_medians`` prints what it measured;
``run_ranks`` runs a function in gloo-ready processes (one per rank) and collects their results.
"""
from __future__ import annotations

import socket
import statistics
import time
from typing import Callable

import torch

QWEN3_NEXT_PEER = dict(
    vocab_size=1000, hidden_size=256, num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
    linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
    intermediate_size=512, norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1,
    mlp_only_layers=[])


def matmul_rate(n: int = 1024, seconds: float = 0.5) -> float:
    """fp32 GFLOP/s of an ``n^3`` matmul on this machine now, on torch's current threads."""
    a = torch.randn(n, n)
    a @ a
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ a
        count += 1
    return 2 * n ** 3 * count / (time.perf_counter() - start) / 1e9


def alternating(contenders: dict, run: Callable, runs: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of ``run(contender)`` per contender name: ``warmup`` untimed rounds, then ``runs``
    rounds in which the contenders take turns, so a change of load hits every one alike."""
    for _ in range(warmup):
        for c in contenders.values():
            run(c)
    times = {name: [] for name in contenders}
    for _ in range(runs):
        for name, c in contenders.items():
            start = time.perf_counter()
            run(c)
            times[name].append(time.perf_counter() - start)
    return times


def report_medians(times: dict[str, list[float]], what: str, width: int = 10) -> dict[str, float]:
    """Prints each contender's median and fastest run of ``what``; returns the medians."""
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, t in med.items():
        print(f"{name:<{width}} {what} median {t * 1e3:8.1f} ms  (min {min(times[name]) * 1e3:.1f})")
    return med


def run_ranks(target: Callable, world: int, *args) -> dict:
    """``target(rank, world, port, *args, out)`` in ``world`` spawned processes (each puts
    ``(rank, result)`` on ``out``; ``port`` is a free one for ``MASTER_PORT``): {rank: result}."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict(out.get() for _ in procs)
    for proc in procs:
        proc.join()
    return results
