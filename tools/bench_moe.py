#!/usr/bin/env python
"""Time megamoe's MoE layer against transformers' sparse MoE block (experts on grouped_mm).

Peer (docs/performance.md, "Peer configurations"; the argument defaults below): 64 experts,
top-8, 4096 tokens, hidden 256, expert intermediate 256, fp32, forward+backward, the same
weights and inputs, 2 threads; median of several alternating runs after warm-up.

    python tools/bench_moe.py                  # last line: moe_speedup_vs_hf=X
    python tools/bench_moe.py --kernels        # also megamoe's other expert kernels
"""
import argparse

import torch
from bench_common import alternating, matmul_rate, report_medians

from megamoe.core.config import ModelConfig, MoEConfig


def hf_block(args):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.ffn, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"  # transformers' default for its models
    block = Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return block


def megamoe_layer(args, hf, kernel: str):
    from megamoe.layers.mlp.moe import MoELayer
    from megamoe.model.language_model import build_context

    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k, moe_ffn_hidden_size=args.ffn, expert_kernel=kernel)
    cfg = ModelConfig(hidden_size=args.hidden, layout="Ae", moe=moe)
    layer = MoELayer(moe, build_context(cfg), 0)
    with torch.no_grad():  # the same weights
        layer.router.weight.copy_(hf.gate.weight)
        layer.experts.gate_up_weight.copy_(hf.experts.gate_up_proj)
        layer.experts.down_weight.copy_(hf.experts.down_proj)
    return layer


def step(module, x, g):
    """One forward+backward; returns the output (detached)."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    (y * g).sum().backward()
    return y.detach()


def peer_arguments(doc: str) -> argparse.ArgumentParser:
    """The peer MoE block's shape and the timing options (tools/bench_lora.py times the same)."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    for name, default in (("tokens", 4096), ("hidden", 256), ("ffn", 256), ("experts", 64), ("top-k", 8),
                          ("runs", 7), ("warmup", 2), ("threads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    return p


def main() -> None:
    p = peer_arguments(__doc__)
    p.add_argument("--kernels", action="store_true", help="also time megamoe's grouped_mm and reference kernels")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    hf = hf_block(args)
    contenders = {"megamoe": megamoe_layer(args, hf, "auto"), "hf": hf}
    if args.kernels:
        for kernel in ("grouped_mm", "reference"):
            contenders[f"megamoe[{kernel}]"] = megamoe_layer(args, hf, kernel)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=gen).requires_grad_(True)
    g = torch.randn(1, args.tokens, args.hidden, generator=gen)

    outs = {name: step(m, x, g) for name, m in contenders.items()}
    err = ((outs["megamoe"] - outs["hf"]).norm() / outs["hf"].norm()).item()
    print(f"same weights and inputs: output relative difference {err:.2e}; "
          f"megamoe kernel: {contenders['megamoe'].experts.resolved_kernel()}")
    times = alternating(contenders, lambda m: step(m, x, g), args.runs, args.warmup - 1)
    med = report_medians(times, "forward+backward", width=22)
    print(f"machine: fp32 matmul {matmul_rate():.0f} GFLOP/s on {torch.get_num_threads()} threads (after the run)")
    print(f"moe_speedup_vs_hf={med['hf'] / med['megamoe']:.2f}")


if __name__ == "__main__":
    main()
