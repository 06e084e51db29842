"""Communication profile of a parallel layout: p50/p90/p99 latency and bus bandwidth of the
collectives megamoe issues, per process group and message size (run under torchrun).

    torchrun --nproc-per-node 4 tools/comm_profile.py --tp 2 --pp 2 [--sizes 4KiB,256KiB,4MiB] [--iters 20]

gloo on CPU, NCCL on GPU. The first rank prints one line per (group, operation, size); every
rank measures (all groups of a kind run at once, as in training).
"""
from __future__ import annotations

from megamoe.commands.cli import number_in, run_main, tool_parser


def parser():
    p = tool_parser(__doc__.strip().splitlines()[0])
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert"), ("etp", "expert tensor")):
        p.add_argument(f"--{name}", type=number_in(int, 1), default=1, help=f"{what} parallel size")
    p.add_argument("--sizes", default="4KiB,256KiB,4MiB", help="message sizes per rank, comma-separated")
    p.add_argument("--iters", type=number_in(int, 1), default=20, help="timed samples per size")
    p.add_argument("--warmup", type=number_in(int, 0), default=3)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    import torch.distributed as dist

    from megamoe.diagnostics.comm_profile import HEADER, parse_sizes, profile
    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.groups import build_groups, init_distributed

    sizes = parse_sizes(args.sizes)
    init_distributed()
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    groups = build_groups(parallel)
    rows = profile(groups, sizes, iters=args.iters, warmup=args.warmup)
    if dist.get_rank() == 0:
        print(f"layout: world {dist.get_world_size()} tp={args.tp} pp={args.pp} ep={args.ep} etp={args.etp} "
              f"dp={parallel.dp(dist.get_world_size())} ({dist.get_backend()}); rank 0's groups")
        print(HEADER)
        for row in rows:
            print(row, flush=True)


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
