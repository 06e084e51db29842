#!/usr/bin/env python
"""Time forward+backward of DeepSeek-V4's attention (letters C and H) against transformers'
``DeepseekV4Attention`` with the same weights, and count what each keeps for backward, in fp32 on
2 CPU threads.

    python tools/bench_compressed.py                 # T=2048, batch 1
    python tools/bench_compressed.py --t 1024 --runs 3

A two-layer transformers model (C then H, default init, sinks and position biases N(0, 0.5)) is
saved and read by ``megamoe.convert.from_hf``. Three sides per letter: megamoe's mixer (the tiled
``compressed_attention`` role), the same mixer with the dense reference op (``naive_compressed_attention``, one [T x (T + N)] score matrix), and
transformers (eager, its sliding-window mask as a dense [T, T] tensor). Shapes: hidden 512, 8
query heads of 128 (32 rotated), query latent 256, window 128, CSA blocks of 4 with an indexer of
8 heads of 64 keeping 128 entries, HCA blocks of 128, 4 output groups of rank 128. Outputs are
checked against each other first. Each side is warmed up once, then the sides alternate for
``--runs`` rounds; the medians of the process CPU time are compared (steadier than wall time on a
shared machine; ``--threads 1`` makes them the work done). Saved bytes: the tensors autograd keeps for backward
(parameters excluded, each storage once). Last line: ``compressed_speedup_vs_hf C=.. H=..
saved_vs_dense C=.. H=..`` (transformers' time / megamoe's; megamoe's saved bytes / the dense op's);
the first line prints the machine's fp32 matmul GFLOP/s (tools/bench_common.py).
"""
import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import matmul_rate  # noqa: E402
from megamoe.diagnostics.memory import saved_tensor_bytes  # noqa: E402


def hf_config(t: int):
    from transformers import DeepseekV4Config

    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}
    hf = DeepseekV4Config(vocab_size=64, hidden_size=512, moe_intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=8, head_dim=128, q_lora_rank=256, partial_rotary_factor=0.25,
                          n_routed_experts=4, num_experts_per_tok=2, sliding_window=128, o_groups=4, o_lora_rank=128,
                          index_n_heads=8, index_head_dim=64, index_topk=128, hc_mult=2, rope_parameters=yarn,
                          layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                          mlp_layer_types=["moe", "moe"], max_position_embeddings=4 * t)
    hf._attn_implementation = "eager"
    return hf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--t", type=int, default=2048)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DeepseekV4ForCausalLM

    from megamoe.convert import from_hf
    from megamoe.layers.ops.compressed_attention import naive_compressed_attention
    from megamoe.layers.spec import ForwardInfo

    hf_cfg = hf_config(args.t)
    torch.manual_seed(0)
    hf_model = DeepseekV4ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # sinks and position biases start at zero: make them matter
        for name, w in hf_model.named_parameters():
            if "sinks" in name or "position_bias" in name:
                w.normal_(0, 0.5)
            if "weights_proj" in name:  # fewer exact-zero indexer scores: ties pick differently (test_dsa)
                w.abs_()
    with tempfile.TemporaryDirectory(prefix="bench_compressed_") as tmp:
        hf_model.save_pretrained(tmp)
        model = from_hf(tmp).float()
    x = torch.randn(1, args.t, 512, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(args.t)[None]
    pe = {k: hf_model.model.rotary_emb(x, pos, layer_type=k) for k in ("main", "compress")}
    i = torch.arange(args.t)
    allowed = (i[None] <= i[:, None]) & (i[None] > i[:, None] - hf_cfg.sliding_window)
    mask = torch.zeros(args.t, args.t).masked_fill(~allowed, float("-inf"))[None, None]
    grad = torch.randn(1, args.t, 512, generator=torch.Generator().manual_seed(1))
    info = ForwardInfo(positions=pos)
    print(f"T={args.t}, {torch.get_num_threads()} threads; machine: fp32 matmul {matmul_rate():.0f} GFLOP/s")
    speed, saved = {}, {}
    for layer, letter in enumerate("CH"):
        hf, ours = hf_model.model.layers[layer].self_attn, model.layers[str(layer)].mixer
        dense = copy.deepcopy(ours)
        dense.core = naive_compressed_attention
        sides = {"megamoe": lambda m=ours: m(x.requires_grad_(True), info),
                 "dense": lambda m=dense: m(x.requires_grad_(True), info),
                 "hf": lambda m=hf: m(x.requires_grad_(True), pe, pos, mask)[0]}
        with torch.no_grad():
            outs = {name: fn() for name, fn in sides.items()}
        err = max((outs[n] - outs["hf"]).abs().max().item() for n in ("megamoe", "dense"))
        times = {name: [] for name in sides}
        for name, fn in sides.items():  # warm-up
            fn().backward(grad)
        for _ in range(args.runs):
            for name, fn in sides.items():
                start = time.process_time()  # CPU time: steadier than wall time on a shared machine
                fn().backward(grad)
                times[name].append(time.process_time() - start)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        kept = {name: saved_tensor_bytes(fn, list(mod.parameters()))[0] for name, fn, mod in
                (("megamoe", sides["megamoe"], ours), ("dense", sides["dense"], dense), ("hf", sides["hf"], hf))}
        print(f"{letter}: max |out - transformers| {err:.1e}; forward+backward median CPU time " +
              ", ".join(f"{n} {t * 1e3:.0f} ms" for n, t in med.items()) + "; saved for backward " +
              ", ".join(f"{n} {b / 2 ** 20:.1f} MiB" for n, b in kept.items()))
        speed[letter], saved[letter] = med["hf"] / med["megamoe"], kept["megamoe"] / kept["dense"]
    print("compressed_speedup_vs_hf " + " ".join(f"{k}={v:.2f}" for k, v in speed.items()) +
          " saved_vs_dense " + " ".join(f"{k}={v:.3f}" for k, v in saved.items()))


if __name__ == "__main__":
    main()
