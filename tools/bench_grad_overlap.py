#!/usr/bin/env python
"""Data-parallel gradient sums overlapped with backward against the sums after it (CPU, gloo).

    python tools/bench_grad_overlap.py [--hidden 512] [--layout AdAdAdAd] [--tokens 256] [--bucket 1048576]

Two gloo processes (DP=2, one torch thread each) train the same dense model (fp32, ZeRO-1) in
two trainers built side by side: ``train.overlap_grad_reduce=true`` (each bucket of
``--bucket`` elements summed asynchronously from backward hooks while the backward goes on) and
``false`` (the reference: the same buckets summed after the whole backward). They take turns,
one training step each (``--runs`` timed after a warm-up), so a change of load hits both alike;
the medians of rank 0's wall seconds per step are compared (the ranks step together). Both
trainers' parameters are checked equal (bitwise) at the end.

Last line: ``grad_overlap_step_ratio=X`` (overlapped / reference step time; < 1: the overlap
hides part of the all-reduce) with the fp32 matmul rate printed beside it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import alternating, matmul_rate, report_medians, run_ranks  # noqa: E402

NAMES = {"after backward": False, "overlapped": True}


def _recipe(args, overlap: bool):
    from megamoe.core.config import AttentionConfig, MLPConfig, ModelConfig, ParallelConfig
    from megamoe.data import DataConfig
    from megamoe.recipe import Recipe
    from megamoe.training.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig

    model = ModelConfig(vocab_size=1000, hidden_size=args.hidden, layout=args.layout,
                        attention=AttentionConfig(num_heads=8, num_kv_heads=8),
                        mlp=MLPConfig(ffn_hidden_size=4 * args.hidden))
    train = TrainConfig(steps=args.runs + 1, micro_batch_size=1, global_batch_size=2, seed=1,
                        overlap_grad_reduce=overlap, grad_bucket_size=args.bucket)
    return Recipe(model=model, parallel=ParallelConfig(), data=DataConfig(kind="synthetic", seq_len=args.tokens),
                  train=train, optim=OptimConfig(warmup_steps=1), checkpoint=CheckpointConfig(),
                  logging=LoggingConfig(progress=False, latency_interval=0))


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from megamoe.training.trainer import Trainer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainers = {name: Trainer(_recipe(args, overlap)) for name, overlap in NAMES.items()}
        gen = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 1000, (1, args.tokens), generator=gen)
        micro = [{"input_ids": ids, "labels": torch.roll(ids, -1, 1)}]
        times = alternating(trainers, lambda t: t.train_step(micro), args.runs, warmup=1)
        a, b = (dict(t.chunks[0].named_parameters()) for t in trainers.values())
        equal = all(torch.equal(a[n], b[n]) for n in a)
        params = sum(p.numel() for p in a.values())
        buckets = len(trainers["overlapped"].grad_sync.buckets)
        out.put((rank, {"times": times, "equal": equal, "params": params, "buckets": buckets}))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--layout", default="AdAdAdAd", help="the model's layout string (dense layers: gradients only "
                                                         "over DP)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank and step (one sequence)")
    p.add_argument("--bucket", type=int, default=1 << 20, help="train.grad_bucket_size (elements)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--runs", type=int, default=8, help="timed steps per contender")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    mm = matmul_rate()
    results = run_ranks(_rank, 2, args)
    first = results[0]
    print(f"layout {args.layout}, hidden {args.hidden}, {first['params'] / 1e6:.1f}M parameters, {args.tokens} tokens "
          f"per rank, DP=2 (gloo), buckets of {args.bucket} elements ({first['buckets']}), fp32; mm {mm:.0f} GFLOP/s "
          f"({args.threads} thread(s)); load average {os.getloadavg()[0]:.1f}")
    med = report_medians(first["times"], "step", width=15)
    assert all(r["equal"] for r in results.values()), "the two trainers' parameters differ"
    print("parameters after the steps: equal bitwise on both ranks")
    print(f"grad_overlap_step_ratio={med['overlapped'] / med['after backward']:.3f} mm_gflops={mm:.0f}")


if __name__ == "__main__":
    main()
