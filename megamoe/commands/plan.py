"""Print the plan of a run without starting it: layout, parameter budget, parallel grid and
per-stage memory per rank; or place experts over EP ranks from their measured load.

    megamoe-plan --config moe_1t --world-size 1024 parallel.tp=8 parallel.pp=4 parallel.ep=64
    megamoe-plan --config hybrid_vl_1t --world-size 1024 --gpu-mem 141GiB [--nodes 128] [lora.rank=16 ...]
    megamoe-plan --config moe_1t --world-size 1024 --long-context parallel.tp=8 parallel.ep=64
    megamoe-plan experts --load LOAD.json --ep 8 [--out PLACEMENT.json]
    megamoe-plan experts --load LOAD.json --ep 8 --redundant 8 [--ep-per-node 8] [--out PLACEMENT.json]
    megamoe-plan experts --calibrate HF_DIR --text FILE --ep 8 [--seq-len 512] [--tokenizer SPEC] [--save-load LOAD.json]
    torchrun --nproc-per-node 4 -m megamoe.commands.plan experts --calibrate HF_DIR --text FILE --ep 8   # distributed

``experts`` reads tokens per expert per MoE layer (JSON {"layers": {"3": [...], ...}}, or a
calibration pass of an HF model over a text file with its tokenizer), prints each layer's
busiest-rank load (max/mean) before and after, and writes the placement that
``megamoe-convert import-hf --placement`` applies (docs/moe.md). With group-limited routing
(``--n-group``, or the calibrated model's ``n_group``) groups stay whole. ``--redundant N``
also gives the N hottest experts (by load per copy) a copy in N extra slots, N/ep per rank
(``model.moe.redundant_experts``), and prints the busiest rank after that too; with groups, a
group's copies stay on its node (``--ep-per-node``). Under torchrun each
rank routes its share of the text's sequences and the counts are summed (rank 0 writes).
"""
import sys

from megamoe.commands.cli import number_in, recipe_parser, run_main, tool_parser
from megamoe.planning.plan import describe, fitting_layouts, long_context_plan, memory_plan, recipe_options
from megamoe.planning.step_time import Hardware, describe_time, rank_layouts
from megamoe.recipe import load_train_recipe


def experts(argv: list[str]) -> None:
    from megamoe.core.placement import read_load, write_json
    from megamoe.planning.placement import balanced_order, imbalance, replicated_placement

    p = tool_parser("Place experts over EP ranks from their measured load")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="JSON of tokens per expert per MoE layer")
    src.add_argument("--calibrate", metavar="HF_DIR", help="measure the load: an HF model over --text")
    p.add_argument("--text", help="with --calibrate: a UTF-8 text file of user data")
    p.add_argument("--tokenizer", help="with --calibrate: tokenizer spec (default: the HF folder's own)")
    p.add_argument("--seq-len", type=number_in(int, 2), default=512, help="with --calibrate: tokens per sequence")
    p.add_argument("--save-load", help="with --calibrate: also write the measured load here")
    p.add_argument("--ep", type=number_in(int, 1), required=True, help="expert-parallel ranks")
    p.add_argument("--n-group", type=number_in(int, 1), help="expert groups of group-limited routing, kept whole "
                   "(default: the calibrated model's n_group, else 1)")
    p.add_argument("--redundant", type=number_in(int, 0), default=0, metavar="N",
                   help="replicas of hot experts in N extra slots, N/ep per rank (model.moe.redundant_experts)")
    p.add_argument("--ep-per-node", type=number_in(int, 1), help="with --redundant and groups: EP ranks per node "
                   "(a group's replicas stay on its node; default: --ep, one node)")
    p.add_argument("--out", help="write the placement here (JSON)")
    args = p.parse_args(argv)
    n_group = args.n_group or 1
    if args.calibrate:
        load, n_group, main_rank = _calibrate(args)
        if not main_rank:
            return
        if args.save_load:
            write_json(args.save_load, load)
    else:
        load = read_load(args.load)
    placement, replicas = {}, {}
    lines = [f"{'layer':>5} {'experts':>8} {'busiest/mean before':>20} {'after':>7}"
             + (f" {'with ' + str(args.redundant) + ' replicas':>16}" if args.redundant else "")]
    for layer, counts in sorted(load.items()):
        order = balanced_order(counts, args.ep, n_group)
        line = (f"{layer:>5} {len(counts):>8} {imbalance(counts, range(len(counts)), args.ep):>20.3f} "
                f"{imbalance(counts, order, args.ep):>7.3f}")
        if args.redundant:
            order, replicas[layer] = replicated_placement(counts, args.ep, args.redundant, n_group, args.ep_per_node)
            line += f" {imbalance(counts, order, args.ep, replicas[layer]):>16.3f}"
        placement[layer] = order
        lines.append(line)
    print("\n".join(lines))  # after every layer is planned: a refusal prints nothing else
    if args.out:
        write_json(args.out, placement, replicas)
        print(f"wrote {args.out} (megamoe-convert import-hf HF_DIR OUT --placement {args.out})")


def _calibrate(args) -> tuple[dict, int, bool]:
    """(tokens per expert per MoE layer, the placement's n_group, whether this rank reports)."""
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from megamoe.convert import from_hf
    from megamoe.data.tokenizer import load_tokenizer
    from megamoe.core.errors import ConfigError
    from megamoe.planning.placement import calibrate

    if not args.text:
        raise ConfigError("--calibrate needs --text FILE (the user data to route)")
    try:
        text = Path(args.text).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{args.text}: cannot read the calibration text ({e})") from None
    ids = torch.tensor(load_tokenizer(args.tokenizer or args.calibrate).encode(text))
    n = ids.numel() // args.seq_len
    if n == 0:
        raise ConfigError(f"{args.text}: {ids.numel()} tokens, fewer than one --seq-len={args.seq_len} sequence")
    batches = ids[:n * args.seq_len].view(n, args.seq_len).split(4)
    group, rank = None, 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: each rank its share, summed
        from megamoe.parallel.groups import init_distributed

        rank, world = init_distributed(device="cpu")
        group, batches = dist.group.WORLD, batches[rank::world]
    model = from_hf(args.calibrate)
    load = calibrate(model, batches, group)
    moe = model.config.moe
    return load, args.n_group or (moe.n_group if moe is not None else 1), rank == 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["experts"]:
        return experts(argv[1:])
    p = recipe_parser(__doc__.strip().splitlines()[0])
    p.add_argument("--world-size", type=number_in(int, 1), default=1, help="number of ranks (GPUs) of the run")
    p.add_argument("--gpu-mem", type=_bytes, help="list the layouts whose every rank fits this much device memory "
                   "(e.g. 141GiB, 80GB)")
    p.add_argument("--nodes", type=number_in(int, 1), help="with --gpu-mem: nodes the ranks are spread over "
                   "(default: 8 GPUs per node); the layouts are ranked by estimated step time")
    p.add_argument("--gpu-tflops", type=number_in(float, 1e-6), default=Hardware.tflops,
                   help="with --gpu-mem: achieved GEMM TFLOP/s per GPU for the step-time estimate (default %(default)s)")
    p.add_argument("--intra-gbps", type=number_in(float, 1e-6), default=Hardware.intra_gbps,
                   help="with --gpu-mem: per-GPU bandwidth inside a node, GB/s (default %(default)s)")
    p.add_argument("--inter-gbps", type=number_in(float, 1e-6), default=Hardware.inter_gbps,
                   help="with --gpu-mem: per-GPU bandwidth between nodes, GB/s (default %(default)s)")
    p.add_argument("--long-context", action="store_true", help="also print the busiest rank's memory at 128K-1M "
                   "tokens per sequence for every context-parallel size (parallel.cp) the world allows")
    args = p.parse_args(argv)
    recipe = load_train_recipe(args.config, args.overrides, validate=False)
    print(describe(recipe.model))
    if args.long_context:
        print(long_context_plan(recipe.model, recipe.parallel, args.world_size, **recipe_options(recipe)))
    if args.gpu_mem:
        return _ranked_layouts(recipe, args)
    recipe.validate_plan(args.world_size)  # what the trainer would refuse, before printing anything
    print(memory_plan(recipe.model, recipe.parallel, args.world_size, recipe.train.micro_batch_size,
                      recipe.data.seq_len, **recipe_options(recipe, recipe.parallel, args.world_size)))


def _ranked_layouts(recipe, args) -> None:
    from megamoe.core.errors import ConfigError

    world = args.world_size
    nodes = args.nodes or (world // 8 if world % 8 == 0 else 1)
    if world % nodes:
        raise ConfigError(f"--nodes={nodes} is invalid: must divide --world-size {world}")
    hw = Hardware(args.gpu_tflops, args.intra_gbps, args.inter_gbps)
    what = "LoRA" if recipe.lora is not None else "full training"
    ranked = rank_layouts(recipe, world, fitting_layouts(recipe, world, args.gpu_mem, most=10 ** 6), world // nodes, hw)
    print(f"layouts of {world} ranks ({nodes} nodes of {world // nodes}) that fit {args.gpu_mem / 2 ** 30:.0f} GiB per "
          f"device ({what}, micro-batch {recipe.train.micro_batch_size} x {recipe.data.seq_len} tokens, global batch "
          f"{recipe.train.global_batch_size}), fastest first by estimated step time ({hw.tflops:g} TFLOP/s, "
          f"{hw.intra_gbps:g} GB/s in a node, {hw.inter_gbps:g} GB/s between nodes, no overlap):")
    for degrees, worst, t in ranked:
        print("  " + " ".join(f"parallel.{k}={v}" for k, v in degrees.items())
              + f"   busiest rank {worst / 2 ** 30:.1f} GiB   {describe_time(t)}")
    if not ranked:
        print("  none (try more ranks, train.optimizer_offload=true, train.recompute=[layer] or LoRA)")


def _bytes(text: str) -> float:
    """'141GiB', '80GB', '512MiB' -> bytes."""
    import re

    from megamoe.core.errors import ConfigError

    m = re.fullmatch(r"\s*([0-9.]+)\s*(KiB|MiB|GiB|TiB|KB|MB|GB|TB)\s*", text)
    units = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--gpu-mem={text!r} is invalid: a size such as 141GiB or 80GB")
    return float(m.group(1)) * units[m.group(2)]


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
