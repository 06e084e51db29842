#!/usr/bin/env python
"""Training-step throughput and memory: megamoe against transformers' Qwen3-Next, same weights.

    python tools/bench_train.py [--runs 5] [--seq 512] [--batch 2] [--recompute mlp]

The peer (docs/performance.md, "Peer configurations"; ``CONFIG`` below):
``Qwen3NextForCausalLM`` (experts on grouped_mm, sdpa attention, GDN on its torch chunk
fallback), fp32, batch 2 x 512, vocab 1000, random weights; megamoe runs the same weights converted with ``megamoe.convert.from_hf``. Each side
runs in its own fresh process (2 threads): load, one warm-up step, then ``--runs`` timed
forward+backward steps; sides alternate over ``--rounds`` rounds and the medians are compared.
Memory is the step's peak resident memory above the process's RSS once the model is loaded
(activations, gradients, workspaces; the weights are the same on both sides); absolute peaks
are printed too. Loading ends, on both sides, with one step on the first 64 tokens: there
megamoe compiles its fused elementwise kernels (``megamoe.layers.ops.fusion``), whose compiler state
(~230 MB, whatever the model or batch size) is thus counted like the weights, in the base
and in the absolute peak, not in the step. Last line: ``train_speedup_vs_hf=X peak_mem_ratio_vs_hf=Y``.

Both children run with the same glibc allocator settings (``ALLOCATOR_ENV``): freed memory
stays in the heap instead of going back to the kernel, so a step does not pay page faults
for buffers the previous step released. Without them the faults' system time varied from
25 to 250 ms per step on this machine, and that noise, not either model, decided the ratio.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import QWEN3_NEXT_PEER

CONFIG = QWEN3_NEXT_PEER  # docs/performance.md, "Peer configurations"

ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
                 "MALLOC_TOP_PAD_": str(1 << 30)}

CHILD = r"""
import gc, json, statistics, sys, time
import torch
torch.set_num_threads(2)
side, hf_dir, runs, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
recompute = [p for p in sys.argv[6].split(",") if p]
from megamoe.diagnostics.memory import peak_rss_mib, reset_peak, rss_mib
gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, 1000, (batch, seq), generator=gen)
if side == "hf":
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.config.use_cache = False
    step = lambda ids: model(input_ids=ids, labels=ids, use_cache=False).loss
else:
    from megamoe.convert import from_hf
    from megamoe.model.language_model import shift_labels
    model = from_hf(hf_dir)
    model.set_recompute(recompute)
    step = lambda ids: model(ids, labels=shift_labels(ids))
model.train()
def run(ids=ids):
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    loss = step(ids)
    loss.backward()
    return time.perf_counter() - start, loss.item()
run(ids[:, :64])  # part of loading: megamoe compiles its fused kernels (megamoe.layers.ops.fusion) here
for p in model.parameters():
    p.grad = None
gc.collect()
reset_peak()
base = rss_mib()
run()  # warm-up
times, losses = [], []
for _ in range(runs):
    t, l = run()
    times.append(t)
    losses.append(l)
print(json.dumps({"times": times, "loss": losses[0], "base_mib": base, "peak_mib": peak_rss_mib()}))
"""


def save_peer(out: Path) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG)).save_pretrained(out)


def measure(side: str, hf_dir: Path, runs: int, batch: int, seq: int, recompute: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, side, str(hf_dir), str(runs), str(batch), str(seq), recompute],
                         check=True, capture_output=True, text=True, env={**os.environ, **ALLOCATOR_ENV})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=2, help="alternating processes per side")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--recompute", default="", help="megamoe's train.recompute parts, comma-separated (e.g. mlp)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "qwen3_next"
        save_peer(hf_dir)
        res = {"hf": [], "megamoe": []}
        for _ in range(args.rounds):
            for side in ("hf", "megamoe"):
                res[side].append(measure(side, hf_dir, args.runs, args.batch, args.seq, args.recompute))
    tokens = args.batch * args.seq
    summary = {}
    for side, rounds in res.items():
        times = [t for r in rounds for t in r["times"]]
        med = statistics.median(times)
        extra = max(r["peak_mib"] - r["base_mib"] for r in rounds)
        peak = max(r["peak_mib"] for r in rounds)
        summary[side] = (med, extra)
        print(f"{side:<8} fwd+bwd median {med * 1e3:8.1f} ms ({tokens / med:7.0f} tokens/s), "
              f"step memory {extra:7.0f} MiB above the loaded model (absolute peak {peak:.0f} MiB), "
              f"loss {rounds[0]['loss']:.5f}")
    speed = summary["hf"][0] / summary["megamoe"][0]
    mem = summary["megamoe"][1] / summary["hf"][1]
    print(f"train_speedup_vs_hf={speed:.2f} peak_mem_ratio_vs_hf={mem:.2f}")


if __name__ == "__main__":
    main()
