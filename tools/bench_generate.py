#!/usr/bin/env python
"""Batched decoding: megamoe against transformers' ``generate`` on the same weights (CPU, fp32).

    python tools/bench_generate.py [--new 32] [--lengths 32,64,96,128] [--rounds 3] [--no-compile]

The peer is the training benchmark's Qwen3-Next (``CONFIG``, docs/performance.md "Peer
configurations"; random weights), saved once and loaded by both sides (megamoe through
``from_hf``). Prompts of different lengths form one batch: transformers gets them left-padded
with an attention mask, megamoe as a list (``generate_batch``, contiguous cache). Greedy, no
EOS. Decode time = time(``--new`` tokens) - time(1 token) (the prefill), each side's median
over ``--rounds`` alternating rounds after a warm-up, 2 threads.

megamoe runs twice: eager decode steps and compiled ones (``generate_batch(..., compile=True)``,
one ``torch.compile``d graph per step; ``--no-compile`` skips it). The compiled side's first
generation, in the untimed warm-up, compiles its graphs: its time is printed
(``compile+first generation``), never folded into the decode times. The last line's X is the
compiled side's (the eager side's without compile); the eager ratio is printed above it.

KV memory: megamoe's int8 paged cache (block 16; one more run) against transformers' cache
after the same generation, attention keys and values only (both keep the linear layers'
conv and recurrent states alike). transformers keeps padded slots too; the paged cache does
not. Last line: ``decode_speedup_vs_hf=X kv_mem_ratio_int8=Y``.

``--v4-cache``: instead, DeepSeek-V4's compressed decode cache (docs/inference.md), measured: a
model with V4-Flash's attention shapes (key head 512, indexer keys 128, rates 4 and 128, window
128; small hidden size, bf16) prefills 1024 then 2048 tokens; per layer kind it prints the cache's
bytes and the bytes each further token adds (the difference over the 1024 tokens between),
against a full cache of every token's key (512 numbers). Last line: ``v4_cache_bytes_per_token
C=.. H=.. W=.. full=..``.
"""
import argparse
import functools
import statistics
import tempfile
import time

import torch

from bench_common import QWEN3_NEXT_PEER, matmul_rate

CONFIG = QWEN3_NEXT_PEER  # docs/performance.md, "Peer configurations"


def hf_side(hf, prompts, new: int):
    """transformers' generate on the left-padded batch -> (new tokens per prompt, its cache)."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                      eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    return out.sequences[:, longest:].tolist(), out.past_key_values


def hf_kv_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def v4_cache_bytes() -> None:
    """The measurement ``--v4-cache`` prints (see the module docstring)."""
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.core.config import CompressedAttentionConfig, DSAConfig, HyperConnectionConfig, ModelConfig, MoEConfig
    from megamoe.model.build import build_model
    from megamoe.model.weights import initialize

    cfg = ModelConfig(vocab_size=256, hidden_size=64, layout="WeCeHe", params_dtype="bfloat16",
                      compressed=CompressedAttentionConfig(num_heads=2, head_dim=512, rope_head_dim=64, q_lora_rank=32,
                                                           o_groups=1, o_lora_rank=16, sliding_window=128, csa_rate=4,
                                                           hca_rate=128, indexer=DSAConfig(2, 128, 512)),
                      moe=MoEConfig(num_experts=2, top_k=1, moe_ffn_hidden_size=16, num_shared_experts=1,
                                    score_function="sqrtsoftplus", expert_bias=True),
                      hyper_connections=HyperConnectionConfig(streams=2, head="learned"))
    model = build_model(cfg).eval()
    initialize(model, model.groups, 0)
    ids = torch.randint(0, 256, (1, 2048), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for tokens in (1024, 2048):
        cache = InferenceCache(1)
        with torch.no_grad():
            model(ids[:, :tokens], cache=cache)
        sizes[tokens] = [sum(t.numel() * t.element_size() for k, t in cache.layer(i).items()
                             if isinstance(t, torch.Tensor) and not k.endswith("#count")) for i in range(3)]
    full = 512 * 2
    per = {}
    for i, kind in enumerate("WCH"):
        per[kind] = (sizes[2048][i] - sizes[1024][i]) / 1024
        print(f"{kind}: cache {sizes[2048][i]} B after 2048 tokens, {per[kind]:.2f} B per further token "
              f"(full cache {full} B per token, {per[kind] / full:.4f} of it)")
    print("v4_cache_bytes_per_token " + " ".join(f"{k}={v:.2f}" for k, v in per.items()) + f" full={full}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--new", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--lengths", default="32,64,96,128", help="prompt lengths (one batch)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="time megamoe's eager decode steps only (no compiled side)")
    p.add_argument("--v4-cache", action="store_true", help="measure DeepSeek-V4's compressed cache instead")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.v4_cache:
        v4_cache_bytes()
        return
    from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    from megamoe.convert import from_hf
    from megamoe.inference.generate import generate_batch, stream
    from megamoe.layers.cache.paged import PagedCache

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, CONFIG["vocab_size"], (int(n),), generator=gen).tolist()
               for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        torch.manual_seed(0)
        Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG)).save_pretrained(tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        mm = from_hf(tmp).eval()
    print(f"fp32 matmul {matmul_rate():.0f} GFLOP/s on {torch.get_num_threads()} threads; "
          f"prompts {args.lengths}, {args.new} new tokens each")

    with torch.no_grad():
        sides = {"megamoe": lambda n: generate_batch(mm, prompts, n),
                 "compiled": lambda n: generate_batch(mm, prompts, n, compile=True),
                 "hf": lambda n: hf_side(hf, prompts, n)[0]}
        if not args.compile:
            del sides["compiled"]
        tokens, first = {}, {}
        for name, fn in sides.items():  # also the warm-up; the compiled side compiles here
            start = time.perf_counter()
            tokens[name] = fn(args.new)
            first[name] = time.perf_counter() - start
        for name in sides:
            if name != "hf":
                same = sum(a == b for ta, tb in zip(tokens[name], tokens["hf"]) for a, b in zip(ta, tb))
                print(f"greedy tokens equal ({name} vs hf): {same}/{len(prompts) * args.new}")
        if args.compile:
            print(f"compiled: compile+first generation {first['compiled']:.1f} s (eager first generation "
                  f"{first['megamoe']:.1f} s)")
        decode = {name: [] for name in sides}
        for _ in range(args.rounds):  # alternate, so load changes hit both sides alike
            for name, fn in sides.items():
                decode[name].append(timed(lambda: fn(args.new)) - timed(lambda: fn(1)))
        med = {name: statistics.median(ts) for name, ts in decode.items()}
        for name, t in med.items():
            per = t / (args.new - 1) * 1e3
            print(f"{name:<8} decode median {t * 1e3:8.1f} ms ({per:.1f} ms per step of {len(prompts)} rows)")
        if args.compile:
            print(f"eager decode_speedup_vs_hf={med['hf'] / med['megamoe']:.2f}, "
                  f"compiled {med['hf'] / med['compiled']:.2f}")

        caches = []
        factory = functools.partial(PagedCache, block_size=16, kv_dtype="int8")
        for _ in stream(mm, prompts, args.new, cache_factory=lambda *a, **k: caches.append(factory(*a, **k)) or caches[-1]):
            pass
        int8_bytes, hf_bytes = caches[0].kv_bytes(), hf_kv_bytes(hf_side(hf, prompts, args.new)[1])
        print(f"KV bytes: megamoe int8 paged {int8_bytes}, transformers {hf_bytes}")
    ours = med["compiled" if args.compile else "megamoe"]
    print(f"decode_speedup_vs_hf={med['hf'] / ours:.2f} kv_mem_ratio_int8={int8_bytes / hf_bytes:.3f}")


if __name__ == "__main__":
    main()
