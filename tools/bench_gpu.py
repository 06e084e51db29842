"""Training steps on one GPU: a hybrid MoE slice in megamoe (bf16, torch FP8) against transformers.

    python tools/bench_gpu.py                  # the default slice, ~0.3B parameters, ~1-2 minutes
    python tools/bench_gpu.py --steps 8 --seq 4096 --hidden 2048 --layers 8 --experts 64
    python tools/bench_gpu.py --plan           # the slice's size only (any machine, no GPU)

The model: Qwen3-Next-shaped, (Gated DeltaNet x3 + gated attention) x layers/4, random weights
saved once as an HF checkpoint; megamoe loads the same weights (``from_hf``). Each side runs bf16
parameters with fused AdamW; steps are timed with CUDA events after warm-up. The defaults are
sized for tools/gpu_check.sh's 120 s bench phase (a 0.6 GB checkpoint written and read twice, fla
kernels compiled once); a slice this small is launch-bound, so mfu_bf16 is low at the defaults.

Last line: ``mfu_bf16=X gpu_speedup_vs_hf=Y grouped_vs_dense=Z fp8_speedup=W``
  X = model FLOPs per step / (megamoe bf16 step time x 989 TFLOP/s, H100/H200 dense bf16)
  Y = transformers' step time / megamoe's (bf16)
  Z = torch's grouped GEMM rate on this slice's expert shapes / a dense bf16 matmul's rate
  W = megamoe bf16 step time / megamoe FP8 step time
Model FLOPs: 6 x active matmul parameters per token, plus causal softmax attention
(6 x 2 x heads x head_dim x seq per attention layer and token, the PaLM convention without
the causal half) and the delta rule's state work (6 x 3 x value heads x dk x dv per GDN layer
and token).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEAK = 989e12


def hf_config(args):
    from transformers import Qwen3NextConfig

    types = (["linear_attention"] * 3 + ["full_attention"]) * (args.layers // 4)
    heads = max(1, args.hidden // 128)
    return Qwen3NextConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                           num_hidden_layers=args.layers, layer_types=types, num_attention_heads=heads,
                           num_key_value_heads=min(2, heads), head_dim=128, linear_num_key_heads=heads,
                           linear_num_value_heads=2 * heads,
                           linear_key_head_dim=128, linear_value_head_dim=128, num_experts=args.experts,
                           num_experts_per_tok=args.topk, moe_intermediate_size=args.ffn,
                           shared_expert_intermediate_size=args.ffn, decoder_sparse_step=1, mlp_only_layers=[],
                           max_position_embeddings=max(4096, args.seq), dtype="bfloat16")


def timed(step, steps: int, warmup: int) -> float:
    """Mean seconds per step over ``steps`` after ``warmup``, by CUDA events."""
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def train_step(model, opt, ids, loss_fn):
    def step():
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def mm_loss(model, ids):
    from megamoe.model.language_model import shift_labels

    return model(ids, labels=shift_labels(ids))


def grouped_vs_dense(args) -> float:
    """Achieved rate of torch's grouped GEMM on the slice's expert shapes (tokens x top-k rows
    over the experts, uneven as routing makes them) / a dense bf16 matmul of the same rows."""
    rows = args.batch * args.seq * args.topk
    g = torch.Generator().manual_seed(0)
    counts = torch.distributions.Dirichlet(torch.ones(args.experts)).sample() * rows
    counts = counts.round().long()
    counts[-1] += rows - counts.sum()
    offs = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(rows, args.hidden, generator=g).cuda().bfloat16()
    w = torch.randn(args.experts, args.hidden, 2 * args.ffn, generator=g).cuda().bfloat16()
    dense_w = torch.randn(args.hidden, 2 * args.ffn, generator=g).cuda().bfloat16()
    flops = 2 * rows * args.hidden * 2 * args.ffn
    t_grouped = timed(lambda: torch._grouped_mm(x, w, offs=offs), 20, 3)
    t_dense = timed(lambda: x @ dense_w, 20, 3)
    print(f"expert GEMM {flops / t_grouped / 1e12:.0f} TFLOP/s grouped, {flops / t_dense / 1e12:.0f} dense")
    return t_dense / t_grouped


def model_flops_per_step(cfg, args) -> float:
    from megamoe.planning.plan import budget

    b = budget(cfg)
    embed = b.parts.get("embedding", (0, 0.0))[1]
    tokens = args.batch * args.seq
    counts = cfg.parsed_layout().counts()
    a, g = cfg.attention, cfg.gdn
    attn = 6 * 2 * a.num_heads * (a.head_dim or cfg.hidden_size // a.num_heads) * args.seq * counts.get("A", 0)
    gdn = 6 * 3 * g.num_value_heads * g.key_head_dim * g.value_head_dim * counts.get("G", 0)
    return tokens * (6 * (b.active - embed) + attn + gdn)


def plan(args) -> None:
    """The slice's parameters (total, routed), checkpoint size and tokens per step, from the
    model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config(args), dtype=torch.bfloat16)
    total = sum(p.numel() for p in hf.parameters())
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    print(f"plan: {total / 1e9:.2f}B parameters ({routed / 1e9:.2f}B in routed experts, top {args.topk} of "
          f"{args.experts}), checkpoint {total * 2 / 2 ** 30:.2f} GiB, {args.batch * args.seq} tokens per step, "
          f"{args.warmup} + {args.steps} steps per side")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="a multiple of 4 (three GDN layers, one attention)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--plan", action="store_true", help="print the slice's size and exit (no GPU needed)")
    args = p.parse_args()
    if args.layers % 4:
        sys.exit(f"error: --layers {args.layers} must be a multiple of 4")
    if args.plan:
        plan(args)
        return
    if not torch.cuda.is_available():
        sys.exit("error: bench_gpu needs a CUDA device")
    from transformers import AutoModelForCausalLM

    from megamoe.convert import from_hf

    torch.manual_seed(0)
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = AutoModelForCausalLM.from_config(hf_config(args), dtype=torch.bfloat16)
        hf.save_pretrained(tmp)
        hf = hf.cuda().train()
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=True)
        results["hf"] = timed(train_step(hf, opt, ids, hf_loss), args.steps, args.warmup)
        print(f"transformers: {results['hf'] * 1e3:.0f} ms/step")
        del hf, opt
        torch.cuda.empty_cache()
        for name, fp8 in (("bf16", None), ("fp8", "torch")):
            model = from_hf(tmp, device="cuda", fp8=fp8).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            results[name] = timed(train_step(model, opt, ids, mm_loss), args.steps, args.warmup)
            print(f"megamoe {name}: {results[name] * 1e3:.0f} ms/step, peak "
                  f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB, backend {model.ctx.backend!r}")
            cfg = model.config
            del model, opt
            torch.cuda.empty_cache()
    flops = model_flops_per_step(cfg, args)
    z = grouped_vs_dense(args)
    print(f"model: {cfg.layout}, {flops / (args.batch * args.seq) / 1e9:.1f} GFLOP per token")
    print(f"mfu_bf16={flops / results['bf16'] / PEAK:.3f} gpu_speedup_vs_hf={results['hf'] / results['bf16']:.2f} "
          f"grouped_vs_dense={z:.2f} fp8_speedup={results['bf16'] / results['fp8']:.2f}")


if __name__ == "__main__":
    main()
