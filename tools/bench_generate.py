#!/usr/bin/env python
"""Batched decoding: megamoe against transformers' ``generate`` on the same weights (CPU, fp32).

    python tools/bench_generate.py [--new 32] [--lengths 32,64,96,128] [--rounds 3] [--no-compile]
                                   [--kv-cache contiguous|paged|int8|fp8]
    python tools/bench_generate.py --kv-peak     # only decode_kv_peak_ratio_int8

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
``--kv-cache``: both megamoe sides decode with that cache (default contiguous; ``paged``,
``int8``, ``fp8``: ``PagedCache`` in blocks of 16, reserved for the generation on the compiled
side), so the compiled paged cache is timed against transformers the same way.

KV memory: megamoe's int8 paged cache (block 16; one more run) against transformers' cache
after the same generation, attention keys and values only (both keep the linear layers'
conv and recurrent states alike). transformers keeps padded slots too; the paged cache does
not. Peak decode memory (``decode_kv_peak``, also alone with ``--kv-peak``): the int8 paged cache
over a bf16 contiguous cache at 16K tokens of context, live tensor bytes of a few decode steps
(the prefill excluded on both sides, the weights taken out), with what each peak is made of
and the ratio's floor (the int8 values alone over the contiguous peak).
Last line: ``decode_speedup_vs_hf=X kv_mem_ratio_int8=Y decode_kv_peak_ratio_int8=Z``.

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


def decode_kv_peak(tokens: int = 16384, steps: int = 4) -> float:
    """Peak decode memory of the int8 paged cache over the bf16 contiguous cache (the measurement
    ``--kv-peak`` prints): a bf16 model of softmax attention (GQA) and MLA layers (``AdMd``, small
    hidden size, so keys dominate) prefills ``tokens`` in 1024-token chunks, then decodes ``steps``
    tokens; per cache, the peak live tensor bytes of those decode steps, the prefill excluded on
    both sides (the cache itself and everything the steps allocate; the weights, alike on both
    sides, left out). Also printed: what each peak is made of, and the floor of the ratio (the
    int8 values alone over the contiguous peak)."""
    from megamoe.core.config import AttentionConfig, MLAConfig, MLPConfig, ModelConfig
    from megamoe.diagnostics.memory import LiveTensorBytes
    from megamoe.layers.cache.decode import InferenceCache
    from megamoe.layers.cache.paged import PagedCache
    from megamoe.model.build import build_model
    from megamoe.model.weights import initialize

    cfg = ModelConfig(vocab_size=256, hidden_size=128, layout="AdMd", params_dtype="bfloat16", max_seq_len=2 * tokens,
                      attention=AttentionConfig(num_heads=8, num_kv_heads=2, head_dim=128),
                      mla=MLAConfig(num_heads=4, kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=32,
                                    v_head_dim=32), mlp=MLPConfig(ffn_hidden_size=256))
    model = build_model(cfg).eval()
    initialize(model, model.groups, 0)
    ids = torch.randint(0, 256, (1, tokens + steps), generator=torch.Generator().manual_seed(0))
    peaks, held = {}, {}
    for name, cache in (("bf16 contiguous", InferenceCache(1)), ("int8 paged", PagedCache(1, kv_dtype="int8"))):
        with torch.no_grad():
            for a in range(0, tokens, 1024):
                model(ids[:, a:a + 1024], cache=cache)
            tracker = LiveTensorBytes()
            tracker.add(model.parameters())  # counted once here (their views would count them anyway), then taken out
            tracker.add(cache.tensors())
            with tracker:
                for i in range(steps):
                    model(ids[:, tokens + i:tokens + i + 1], cache=cache)
        weights = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())
        peaks[name], held[name] = tracker.peak - weights, sum(t.untyped_storage().nbytes() for t in cache.tensors())
        print(f"{name}: peak decode memory {peaks[name] / 2**20:.2f} MiB at {tokens} tokens of context "
              f"(cache {held[name] / 2**20:.2f} MiB{int8_parts(cache)}; above it at the peak "
              f"{(peaks[name] - held[name]) / 2**20:.2f} MiB)")
    values = held["bf16 contiguous"] / 2  # the int8 values of the same keys: half the bf16 bytes
    print(f"floor: the int8 values alone ({values / 2**20:.2f} MiB) over the bf16 contiguous peak = "
          f"{values / peaks['bf16 contiguous']:.3f}")
    return peaks["int8 paged"] / peaks["bf16 contiguous"]


def int8_parts(cache) -> str:
    """A paged cache's bytes: values and scales of the blocks in use, and the pool's unused blocks."""
    stores = cache.block_stores() if hasattr(cache, "block_stores") else []
    if not stores:
        return ""
    used = sum(s.bytes_in_use() for s in stores)
    scales = sum(s.blocks_in_use() * s.scales[0][0].numel() * 4 for s in stores if s.quantized)
    pool = sum(t.untyped_storage().nbytes() for s in stores for t in s.chunks + s.scales)
    return (f": int8 values {(used - scales) / 2**20:.2f}, scales {scales / 2**20:.2f}, "
            f"unused pool blocks {(pool - used) / 2**20:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--new", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--lengths", default="32,64,96,128", help="prompt lengths (one batch)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="time megamoe's eager decode steps only (no compiled side)")
    p.add_argument("--kv-cache", choices=("contiguous", "paged", "int8", "fp8"), default="contiguous",
                   help="the cache both megamoe sides decode with (paged, int8, fp8: PagedCache in blocks of 16)")
    p.add_argument("--v4-cache", action="store_true", help="measure DeepSeek-V4's compressed cache instead")
    p.add_argument("--kv-peak", action="store_true",
                   help="measure only the int8 paged / bf16 contiguous peak decode memory at 16K tokens")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.v4_cache:
        v4_cache_bytes()
        return
    if args.kv_peak:
        print(f"fp32 matmul {matmul_rate():.0f} GFLOP/s on {torch.get_num_threads()} threads")
        print(f"decode_kv_peak_ratio_int8={decode_kv_peak():.3f}")
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

    kv = {} if args.kv_cache == "contiguous" else {"cache_factory": functools.partial(
        PagedCache, block_size=16, kv_dtype="fp32" if args.kv_cache == "paged" else args.kv_cache)}
    print(f"megamoe's cache: {args.kv_cache}")
    with torch.no_grad():
        sides = {"megamoe": lambda n: generate_batch(mm, prompts, n, **kv),
                 "compiled": lambda n: generate_batch(mm, prompts, n, compile=True, **kv),
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
            print(f"greedy tokens equal (compiled vs megamoe): {tokens['compiled'] == tokens['megamoe']}")
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
    peak = decode_kv_peak()
    print(f"decode_speedup_vs_hf={med['hf'] / ours:.2f} kv_mem_ratio_int8={int8_bytes / hf_bytes:.3f} "
          f"decode_kv_peak_ratio_int8={peak:.3f}")


if __name__ == "__main__":
    main()
