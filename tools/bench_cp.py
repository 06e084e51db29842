"""Context parallelism on CPU: one hybrid MoE layer stack at >= 32K tokens (fp32, small width),
forward and backward at CP=1 (one process) against CP=2 (two gloo processes), in the same run.

    python tools/bench_cp.py                         # (GeGeGeAe), hidden 64, 32K tokens
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

Last line: ``cp_act_mem_ratio=X linear_cp_bytes_per_layer=Y softmax_cp_bytes_per_layer=Z`` —
X = the larger CP=2 rank's saved activation bytes / CP=1's (target <= 0.55), Y and Z at the
longest length (Y at both lengths on the line before). The line before those:
``cp_time_ratio``, the slower CP=2 rank's seconds / CP=1's (indicative: wall clock on a shared
CPU, the two ranks running at once).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import matmul_rate  # noqa: E402
from megamoe.diagnostics.memory import saved_tensor_bytes  # noqa: E402

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "send", "isend", "broadcast", "batch_isend_irecv")


def model_config(args):
    from megamoe.core.config import AttentionConfig, GDNConfig, KDAConfig, LightningConfig, MLPConfig, ModelConfig, MoEConfig

    h = args.hidden
    return ModelConfig(vocab_size=256, hidden_size=h, layout=args.layout, max_seq_len=args.tokens,
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


def stack_run(args, groups, seed: int = 0) -> dict:
    """Saved activation bytes and seconds of one forward+backward of the stack (loss over all tokens)."""
    from megamoe.model.language_model import LanguageModel, shift_labels
    from megamoe.model.weights import initialize

    model = LanguageModel(model_config(args), groups)
    initialize(model, groups, seed)
    model.train()
    ids = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    act, loss = saved_tensor_bytes(lambda: model(ids, labels=shift_labels(ids)), model.parameters())
    loss.backward()
    return {"act": act, "seconds": time.perf_counter() - start, "loss": loss.item()}


def mixer_bytes(args, groups, letter: str, tokens: int) -> int:
    """Bytes one rank exchanges in one ``letter`` mixer's forward+backward at ``tokens`` tokens."""
    from megamoe.model.language_model import LanguageModel
    from megamoe.parallel.context import ContextShard
    from megamoe.layers.spec import ForwardInfo
    from megamoe.model.weights import initialize

    cfg = model_config(args)
    cfg.layout = f"{letter}n"
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
        result = {}
        if rank == 0:  # CP=1 first, alone, so the two CP=2 ranks do not share the cores with it
            result["cp1"] = stack_run(args, ParallelGroups())
        dist.barrier()
        groups = build_groups(ParallelConfig(cp=2), timeout_s=3 * 3600)
        result["cp2"] = stack_run(args, groups)
        linear = next((c for c in args.layout if c in "GKL"), None)
        soft = next((c for c in args.layout if c in "ASMDI"), None)
        if linear:
            result["linear"] = [mixer_bytes(args, groups, linear, n) for n in (args.tokens // 2, args.tokens)]
        if soft:
            result["softmax"] = mixer_bytes(args, groups, soft, args.tokens)
        out.put((rank, result))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--layout", default="GeGeGeAe", help="the layer stack (a hybrid MoE layout string)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens of the one sequence (>= 32K for the record)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    mm = matmul_rate()
    print(f"layout {args.layout}, hidden {args.hidden}, {args.tokens} tokens, fp32, CPU; mm {mm:.0f} GFLOP/s "
          f"({args.threads} thread(s)); load average {os.getloadavg()[0]:.1f}", flush=True)
    port = s = None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(out.get() for _ in procs)
    for proc in procs:
        proc.join()
    one = results[0]["cp1"]
    two = [results[r]["cp2"] for r in (0, 1)]
    print(f"CP=1: saved activations {one['act'] / 2 ** 20:.1f} MiB, loss {one['loss']:.6f}, "
          f"forward+backward {one['seconds']:.1f} s")
    for r, t in enumerate(two):
        print(f"CP=2 rank {r}: saved activations {t['act'] / 2 ** 20:.1f} MiB, loss {t['loss']:.6f}, "
              f"forward+backward {t['seconds']:.1f} s")
    ratio = max(t["act"] for t in two) / one["act"]
    # both CP=2 ranks share the cores, CP=1 ran alone: indicative only, and only on a quiet machine
    print(f"cp_time_ratio={max(t['seconds'] for t in two) / one['seconds']:.3f} (the slower CP=2 rank's "
          f"forward+backward seconds / CP=1's; ideal 0.5 with a core per rank)")
    linear = max(results[r].get("linear", [0, 0])[1] for r in (0, 1))
    softmax = max(results[r].get("softmax", 0) for r in (0, 1))
    if "linear" in results[0]:
        a, b = (max(results[r]["linear"][i] for r in (0, 1)) for i in (0, 1))
        print(f"linear-attention layer exchanges {a} bytes at {args.tokens // 2} tokens, {b} at {args.tokens}")
    print(f"cp_act_mem_ratio={ratio:.3f} linear_cp_bytes_per_layer={linear} softmax_cp_bytes_per_layer={softmax}")


if __name__ == "__main__":
    main()
