#!/usr/bin/env python
"""Time a LoRA fine-tuning step of a MoE layer: megamoe's expert adapters against PEFT's
(``target_parameters`` on transformers' stacked experts), the same weights and adapters.

Peer shape as tools/bench_moe.py (64 experts, top-8, 4096 tokens, hidden 256, expert
intermediate 256, fp32, 2 threads), adapters of rank 8 on both expert tensors, frozen base:
forward + backward computes the input and adapter gradients. Median of alternating runs.

    python tools/bench_lora.py                 # last line: lora_speedup_vs_peft=X
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import hf_block, megamoe_layer, step  # noqa: E402  (the same MoE peer and weights)


def contenders(args):
    """(megamoe layer, PEFT-wrapped transformers block): the same base weights, PEFT's random
    adapters (so they matter) copied into megamoe's layout."""
    from peft import LoraConfig, get_peft_model

    from megamoe.lora import LoRAConfig, apply_lora
    from megamoe.parallel.groups import ParallelGroups

    hf = hf_block(args)
    layer = megamoe_layer(args, hf, "auto")
    torch.manual_seed(2)
    peft = get_peft_model(hf, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, init_lora_weights=False,
                                         target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    apply_lora(layer, LoRAConfig(rank=args.rank, alpha=2 * args.rank, targets=["experts"]), groups=ParallelGroups())
    e, r = args.experts, args.rank
    experts = peft.base_model.model.experts
    wrappers = {"down": experts, "gate_up": experts.base_layer}  # the last registered is outermost
    with torch.no_grad():
        for prefix, wrapper in wrappers.items():
            a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight  # [E*r, in], [out, r*E]
            getattr(layer.experts, f"{prefix}_lora_A").copy_(a.view(e, r, -1))
            getattr(layer.experts, f"{prefix}_lora_B").copy_(b.view(b.size(0), r, e).permute(2, 0, 1))
    return layer, peft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    layer, peft = contenders(args)
    models = {"megamoe": layer, "peft": peft}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=gen).requires_grad_(True)
    g = torch.randn(1, args.tokens, args.hidden, generator=gen)
    outs = {name: step(m, x, g) for name, m in models.items()}
    err = ((outs["megamoe"] - outs["peft"]).norm() / outs["peft"].norm()).item()
    print(f"same weights, adapters and inputs: output relative difference {err:.2e}")
    for _ in range(args.warmup - 1):
        for m in models.values():
            step(m, x, g)
    times = {name: [] for name in models}
    for _ in range(args.runs):  # alternate, so load changes hit both alike
        for name, m in models.items():
            t = time.perf_counter()
            step(m, x, g)
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, t in med.items():
        print(f"{name:<10} LoRA forward+backward median {t * 1e3:8.1f} ms  (min {min(times[name]) * 1e3:.1f})")
    print(f"lora_speedup_vs_peft={med['peft'] / med['megamoe']:.2f}")


if __name__ == "__main__":
    main()
