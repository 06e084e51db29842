"""Context parallelism on CPU: hybrid MoE layer stacks at 16K tokens, CP=1 against CP=2.

Forward and backward (fp32, small width) at CP=1 (one process) against CP=2 (two gloo
processes), in the same run.

    python tools/bench_cp.py                         # GeGeGeAe, AdAdAdAd, GdGdGdGd; hidden 64, 16K tokens
    python tools/bench_cp.py --tokens 65536 --layout GeKeLeAe

Activation memory is measured as the bytes autograd saves for backward during the forward
(``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, parameters and their
views left out): what a rank holds between forward and backward, the peak of a layer stack's
activations. Exchanged bytes are what one rank hands to ``torch.distributed`` collectives and
sends (the input of all_gather / all_reduce / reduce_scatter / all_to_all; the tensors of
send, isend and of the isend operations in batch_isend_irecv, the ring's transfers) during one
mixer layer's forward and backward at CP=2, measured for one linear-attention layer at two
lengths (it must not grow with the sequence: the states passed do not depend on it) and one
softmax layer.

Time is each process's CPU seconds (``time.process_time``, one torch thread per process) over
the forward and backward, so a machine shared with other work does not distort it; wall seconds
are printed beside. CPU seconds leave out a rank's waits for its peer: on one machine those are
the transfers of the ring and the state exchange, which a fast interconnect overlaps.

Per layout: ``cp_time_ratio[L]=X`` (the slower CP=2 rank's CPU seconds / CP=1's; targets: <= 0.7,
ideal 0.5). Last lines, for the first layout (the default one): ``cp_time_ratio=X`` (target
<= 0.65) and ``cp_act_mem_ratio=X linear_cp_bytes_per_layer=Y softmax_cp_bytes_per_layer=Z`` —
X = the larger CP=2 rank's saved activation bytes / CP=1's (target <= 0.55), Y and Z at the
longest length (Y at both lengths on the line before).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import matmul_rate, run_ranks  # noqa: E402
from megamoe.diagnostics.memory import saved_tensor_bytes  # noqa: E402

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "send", "isend", "broadcast", "batch_isend_irecv")


def model_config(args, layout: str):
    from megamoe.core.config import AttentionConfig, GDNConfig, KDAConfig, LightningConfig, MLPConfig, ModelConfig, MoEConfig

    h = args.hidden
    return ModelConfig(vocab_size=256, hidden_size=h, layout=layout, max_seq_len=args.tokens,
                       attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=h // 4),
                       gdn=GDNConfig(num_key_heads=2, num_value_heads=4, key_head_dim=h // 4, value_head_dim=h // 4),
                       kda=KDAConfig(num_heads=4, head_dim=h // 4), lightning=LightningConfig(num_heads=4),
                       mlp=MLPConfig(ffn_hidden_size=2 * h),
                       moe=MoEConfig(num_experts=8, top_k=2, moe_ffn_hidden_size=h, num_shared_experts=1))


class ByteCounter:
    """Counts the bytes this rank hands to torch.distributed collectives while active."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.bytes, self.saved = dist, 0, {}

    @staticmethod
    def _size(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(ByteCounter._size(t) for t in x)
        return 0

    def __enter__(self):
        for name in COLLECTIVES:
            fn = getattr(self.dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn
            # the data a rank contributes: the input (the last tensor argument of the gather/scatter
            # forms, whose first argument is the output)
            index = 1 if name in ("all_gather", "all_gather_into_tensor", "reduce_scatter",
                                  "reduce_scatter_tensor", "all_to_all", "all_to_all_single") else 0

            def counted(*a, _fn=fn, _i=index, _name=name, **kw):
                if _name == "batch_isend_irecv":  # P2POps: the isend ones leave this rank
                    isend = self.saved.get("isend", self.dist.isend)  # the unwrapped op P2POp holds
                    self.bytes += sum(self._size(op.tensor) for op in a[0] if op.op is isend)
                else:
                    self.bytes += self._size(a[_i] if len(a) > _i else next(iter(kw.values()), None))
                return _fn(*a, **kw)

            setattr(self.dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)


def stack_run(args, layout: str, groups, seed: int = 0) -> dict:
    """Saved activation bytes, CPU and wall seconds of one forward+backward of the stack (loss
    over all tokens)."""
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.weights import initialize

    model = LanguageModel(model_config(args, layout), groups)
    initialize(model, groups, seed)
    model.train()
    ids = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(seed))
    wall, cpu = time.perf_counter(), time.process_time()
    act, loss = saved_tensor_bytes(lambda: model(ids, labels=shift_labels(ids)), model.parameters())
    loss.backward()
    return {"act": act, "cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall, "loss": loss.item()}


def repeated(args, layout: str, groups) -> dict:
    """``stack_run`` ``args.repeats`` times; the first warms up (the cpu backend compiles its fused
    elementwise kernels for the shapes it meets), the fastest of the others counts."""
    runs = [stack_run(args, layout, groups) for _ in range(args.repeats)]
    return min(runs[1:] or runs, key=lambda r: r["cpu"])


def mixer_bytes(args, layout: str, groups, letter: str, tokens: int) -> int:
    """Bytes one rank exchanges in one ``letter`` mixer's forward+backward at ``tokens`` tokens."""
    from megamoe.model.language_model import LanguageModel
    from megamoe.parallel.context import ContextShard
    from megamoe.layers.spec import ForwardInfo
    from megamoe.model.weights import initialize

    cfg = model_config(args, f"{letter}n")
    model = LanguageModel(cfg, groups)
    initialize(model, groups, 0)
    mixer = model.layers["0"].mixer
    shard = ContextShard(groups.cp, tokens)
    x = torch.randn(1, shard.local_len, args.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    info = ForwardInfo(positions=shard.local_index().unsqueeze(0), cp=shard)
    with ByteCounter() as counter:
        mixer(x, info).square().sum().backward()
    return counter.bytes


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    from megamoe.core.config import ParallelConfig
    from megamoe.parallel.groups import ParallelGroups, build_groups

    from datetime import timedelta

    # rank 1 waits at the barrier while rank 0 runs CP=1 alone (long at 32K tokens on a busy CPU)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(hours=3))
    try:
        groups, result = None, {}
        for layout in args.layouts:
            if rank == 0:  # CP=1 first, alone, so the two CP=2 ranks do not share the cores with it
                result[layout, "cp1"] = repeated(args, layout, ParallelGroups())
            dist.barrier()
            groups = groups or build_groups(ParallelConfig(cp=2), timeout_s=3 * 3600)
            result[layout, "cp2"] = repeated(args, layout, groups)
        layout = args.layouts[0]
        linear = next((c for c in layout if c in "GKL"), None)
        soft = next((c for c in layout if c in "ASMDI"), None)
        if linear:
            result["linear"] = [mixer_bytes(args, layout, groups, linear, n) for n in (args.tokens // 2, args.tokens)]
        if soft:
            result["softmax"] = mixer_bytes(args, layout, groups, soft, args.tokens)
        out.put((rank, result))
    finally:
        dist.destroy_process_group()


def report(args, results) -> None:
    """The per-layout lines, then the first layout's ratios (module docstring)."""
    for layout in args.layouts:
        one = results[0][layout, "cp1"]
        two = [results[r][layout, "cp2"] for r in (0, 1)]
        print(f"{layout} CP=1: saved activations {one['act'] / 2 ** 20:.1f} MiB, loss {one['loss']:.6f}, "
              f"forward+backward {one['cpu']:.1f} CPU s ({one['wall']:.1f} s wall)")
        for r, t in enumerate(two):
            print(f"{layout} CP=2 rank {r}: saved activations {t['act'] / 2 ** 20:.1f} MiB, loss {t['loss']:.6f}, "
                  f"forward+backward {t['cpu']:.1f} CPU s ({t['wall']:.1f} s wall)")
        time_ratio = max(t["cpu"] for t in two) / one["cpu"]
        mem_ratio = max(t["act"] for t in two) / one["act"]
        print(f"cp_time_ratio[{layout}]={time_ratio:.3f} cp_act_mem_ratio[{layout}]={mem_ratio:.3f}")
    first = args.layouts[0]
    one, two = results[0][first, "cp1"], [results[r][first, "cp2"] for r in (0, 1)]
    print(f"cp_time_ratio={max(t['cpu'] for t in two) / one['cpu']:.3f} (layout {first}: the slower CP=2 rank's "
          f"forward+backward CPU seconds / CP=1's; ideal 0.5)")
    linear = max(results[r].get("linear", [0, 0])[1] for r in (0, 1))
    softmax = max(results[r].get("softmax", 0) for r in (0, 1))
    if "linear" in results[0]:
        a, b = (max(results[r]["linear"][i] for r in (0, 1)) for i in (0, 1))
        print(f"linear-attention layer exchanges {a} bytes at {args.tokens // 2} tokens, {b} at {args.tokens}")
    ratio = max(t["act"] for t in two) / one["act"]
    print(f"cp_act_mem_ratio={ratio:.3f} linear_cp_bytes_per_layer={linear} softmax_cp_bytes_per_layer={softmax}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--layout", action="append", dest="layouts", metavar="LAYOUT",
                   help="a layer stack (hybrid MoE layout string); repeat for several; the first one's ratios end "
                        "the output (default: GeGeGeAe, AdAdAdAd, GdGdGdGd)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the one sequence")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--repeats", type=int, default=2, help="forward+backward runs per layout and CP size: the first "
                                                         "warms up, the fastest of the others counts")
    args = p.parse_args(argv)
    args.layouts = args.layouts or ["GeGeGeAe", "AdAdAdAd", "GdGdGdGd"]
    torch.set_num_threads(args.threads)
    mm = matmul_rate()
    print(f"layouts {' '.join(args.layouts)}, hidden {args.hidden}, {args.tokens} tokens, fp32, CPU; mm {mm:.0f} "
          f"GFLOP/s ({args.threads} thread(s)); load average {os.getloadavg()[0]:.1f}", flush=True)
    report(args, run_ranks(_rank, 2, args))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
