"""Peak memory of shard-local initialisation: 4 gloo processes at TP=2 x EP=2 build and
initialise a hybrid MoE of >= 2B parameters; each rank reports its peak RSS and its shard.

    python tools/bench_init.py                 # 2.1B parameters, bf16
    python tools/bench_init.py --experts 32    # smaller

Last line: ``init_peak_rss_over_shard=X`` (the largest rank's peak RSS during the build and
initialisation / that rank's parameter bytes; the interpreter, torch and megatron-core count
in the RSS too, which is why X cannot reach 1). Before shard-local initialisation every rank
drew each full tensor (one expert stack of this model: 1.6 GB in fp32) on the way.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

from bench_common import matmul_rate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overrides(args) -> list[str]:
    return [f"model.layout=(GeGeAe)*{args.repeats}", f"model.hidden_size={args.hidden}",
            f"model.vocab_size={args.vocab}", f"model.moe.num_experts={args.experts}", "model.moe.top_k=8",
            f"model.moe.moe_ffn_hidden_size={args.ffn}", f"model.params_dtype={args.dtype}",
            "model.attention.num_heads=16", "model.attention.num_kv_heads=4", "model.attention.head_dim=128",
            "model.gdn.num_key_heads=8", "model.gdn.num_value_heads=16",
            "model.gdn.key_head_dim=128", "model.gdn.value_head_dim=128"]


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from megamoe.core.config import ParallelConfig
    from megamoe.model.build import build_model
    from megamoe.parallel.groups import build_groups
    from megamoe.model.params import count_parameters
    from megamoe.recipe import load_recipe
    from megamoe.model.weights import initialize

    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_recipe("tiny_hybrid_moe", _overrides(args)).model
    groups = build_groups(ParallelConfig(tp=2, ep=2))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    model = build_model(cfg, groups)
    initialize(model, groups, seed=0)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    total = count_parameters(model, groups).total if rank == 0 else 0
    out.put((rank, peak, before, shard, seconds, total))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    world, ctx = 4, mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    rows = sorted(out.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    total = rows[0][5]
    print(f"machine: fp32 matmul {matmul_rate():.0f} GFLOP/s on {torch.get_num_threads()} threads (after the run)")
    print(f"model: {total / 1e9:.2f}B parameters ({args.dtype}), TP=2 x EP=2, 4 gloo processes")
    print(f"{'rank':>4} {'peak RSS GiB':>13} {'RSS before build':>17} {'shard GiB':>10} {'init s':>7}")
    for rank, peak, before, shard, seconds, _ in rows:
        print(f"{rank:>4} {peak / 2 ** 30:>13.2f} {before / 2 ** 30:>17.2f} {shard / 2 ** 30:>10.2f} {seconds:>7.1f}")
    worst = max(rows, key=lambda r: r[1] / r[3])
    print(f"init_peak_rss_over_shard={worst[1] / worst[3]:.2f}")


if __name__ == "__main__":
    main()
