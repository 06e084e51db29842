#!/usr/bin/env python
"""Time forward+backward of megamoe's chunked gated delta rule (GDN) and KDA against the torch
chunk functions of transformers (qwen3_next's ``torch_chunk_gated_delta_rule``, kimi_linear's
``chunk_kimi_delta_attention``) on identical inputs, in fp32 on 2 CPU threads.

    python tools/bench_mixers.py                      # T=2048, H=4, D=64, batch 1
    python tools/bench_mixers.py --t 512 --runs 3
    git show REV:layers/ops/delta_rule/chunk.py > /tmp/op_before.py  # before the move: layers/linear_attention/chunk_delta.py
    python tools/bench_mixers.py --baseline-op /tmp/op_before.py   # this tree's op against REV's

Each case is warmed up once, then megamoe and the peer alternate for ``--runs`` rounds; the
medians are compared. Outputs and input gradients are checked against each other first.
The last line is ``gdn_speedup_vs_hf=X kda_speedup_vs_hf=Y`` (peer time / megamoe time).
``--baseline-op`` times ``chunk_delta_rule`` from another file in the same rounds (it imports
the rest of megamoe from this tree, so the GDN case compares delta_rule/chunk.py only, not
delta_rule/chunk_gated.py) and adds a line ``gdn_time_vs_baseline=.. gdn_cpu_vs_baseline=..
kda_time_vs_baseline=.. kda_cpu_vs_baseline=..``: megamoe's wall time (and process CPU time)
over the baseline's, the median of the rounds' ratios (on a loaded machine the CPU time of a
1-thread run, ``--threads 1``, is the steadier figure).
"""
import argparse
import importlib.util
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from megamoe.core.config import GDNConfig, KDAConfig
from megamoe.layers.ops.fusion import Fusion
from megamoe.layers.ops.delta_rule.chunk import chunk_delta_rule


def peers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    return torch_chunk_gated_delta_rule, chunk_kimi_delta_attention


def make_inputs(t: int, heads: int, dim: int, per_channel: bool, seed: int = 0):
    """q, k unit-norm (as the mixers feed the op), g = logsigmoid(N(0,1)) <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, t, heads, dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, t, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, t, heads, dim, generator=gen)
    g = F.logsigmoid(torch.randn((1, t, heads, dim) if per_channel else (1, t, heads), generator=gen))
    beta = torch.rand(1, t, heads, generator=gen)
    return q, k, v, g, beta


def fwd_bwd(fn, inputs, grad_out):
    """One forward+backward; returns ((wall seconds, process CPU seconds), output, input gradients)."""
    xs = [x.clone().requires_grad_(True) for x in inputs]
    start, cpu = time.perf_counter(), time.process_time()
    out = fn(*xs)
    out.backward(grad_out)
    return (time.perf_counter() - start, time.process_time() - cpu), out.detach(), [x.grad for x in xs]


def load_op(path: str):
    """``chunk_delta_rule`` from a copy of delta_rule/chunk.py (e.g. an earlier commit's)."""
    spec = importlib.util.spec_from_file_location("baseline_chunk_delta", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chunk_delta_rule


def bench(fns, inputs, runs: int):
    """fns[0] is megamoe's; all alternate, one call each per round. Returns each one's times and
    the largest difference of any output or input gradient from fns[0]'s."""
    grad_out = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(1))
    first = [fwd_bwd(fn, inputs, grad_out)[1:] for fn in fns]  # warm-up, and the cross-check
    (o_ref, g_ref) = first[0]
    diff = max((a - b).abs().max().item() for o, g in first[1:] for a, b in zip([o_ref, *g_ref], [o, *g]))
    times = [[] for _ in fns]
    for _ in range(runs):
        for fn, t in zip(fns, times):
            t.append(fwd_bwd(fn, inputs, grad_out)[0])
    return times, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--t", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline-op", metavar="FILE",
                   help="a copy of layers/ops/delta_rule/chunk.py (e.g. git show REV:layers/ops/delta_rule/chunk.py) "
                        "whose chunk_delta_rule is timed in the same rounds")
    args = p.parse_args()
    base = load_op(args.baseline_op) if args.baseline_op else None
    torch.set_num_threads(args.threads)
    hf_gdn, hf_kda = peers()
    # the chunk lengths the mixers use for these head dims
    c_gdn = GDNConfig(key_head_dim=args.dim, value_head_dim=args.dim).resolved_chunk_size()
    c_kda = KDAConfig().chunk_size
    fuse = Fusion.from_config(None).active(torch.device("cpu"))  # as a model built here would (MEGAMOE_FUSION)
    cases = {
        "gdn": (lambda op: lambda *x: op(*x, chunk_size=c_gdn, fuse=fuse)[0],
                lambda *x: hf_gdn(*x[:3], g=x[3], beta=x[4])[0], False),
        "kda": (lambda op: lambda *x: op(*x, chunk_size=c_kda, fuse=fuse)[0],
                lambda *x: hf_kda(*x[:3], g=x[3], beta=x[4])[0], True),
    }
    speedups, vs_base = {}, {}
    for name, (ours, peer, per_channel) in cases.items():
        inputs = make_inputs(args.t, args.heads, args.dim, per_channel)
        fns = [ours(chunk_delta_rule), peer] + ([ours(base)] if base else [])
        times, diff = bench(fns, inputs, args.runs)
        wall = [[w for w, _ in t] for t in times]
        t_ours, t_peer = statistics.median(wall[0]), statistics.median(wall[1])
        speedups[name] = t_peer / t_ours
        chunk = c_gdn if name == "gdn" else c_kda
        line = (f"{name}: T={args.t} H={args.heads} D={args.dim} chunk={chunk} fwd+bwd median of {args.runs}: "
                f"megamoe {t_ours * 1e3:.1f} ms, transformers {t_peer * 1e3:.1f} ms, ")
        if base:
            vs_base[name] = [statistics.median(a[i] / b[i] for a, b in zip(times[0], times[2])) for i in (0, 1)]
            line += f"baseline op {statistics.median(wall[2]) * 1e3:.1f} ms, "
        print(line + f"speedup {speedups[name]:.2f}x (max abs diff of output and grads {diff:.1e})")
    print(f"gdn_speedup_vs_hf={speedups['gdn']:.2f} kda_speedup_vs_hf={speedups['kda']:.2f}")
    if base:
        print(" ".join(f"{name}_{kind}_vs_baseline={vs_base[name][i]:.3f}"
                       for name in vs_base for i, kind in enumerate(("time", "cpu"))))

if __name__ == "__main__":
    main()
