#!/usr/bin/env python
"""Time a LoRA fine-tuning step of a MoE layer: megamoe's expert adapters against PEFT's
(``target_parameters`` on transformers' stacked experts), the same weights and adapters.

Peer shape as tools/bench_moe.py (64 experts, top-8, 4096 tokens, hidden 256, expert
intermediate 256, fp32, 2 threads), adapters of rank 8 on both expert tensors, frozen base:
forward + backward computes the input and adapter gradients. Median of alternating runs.

    python tools/bench_lora.py                 # last line: lora_speedup_vs_peft=X
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import alternating, matmul_rate, report_medians  # noqa: E402
from bench_moe import hf_block, megamoe_layer, peer_arguments, step  # noqa: E402  (the same MoE peer and weights)


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
    p = peer_arguments(__doc__)
    p.add_argument("--rank", type=int, default=8)
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
    times = alternating(models, lambda m: step(m, x, g), args.runs, args.warmup - 1)
    med = report_medians(times, "LoRA forward+backward")
    print(f"machine: fp32 matmul {matmul_rate():.0f} GFLOP/s on {torch.get_num_threads()} threads (after the run)")
    print(f"lora_speedup_vs_peft={med['peft'] / med['megamoe']:.2f}")


if __name__ == "__main__":
    main()
