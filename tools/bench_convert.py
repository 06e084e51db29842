#!/usr/bin/env python
"""Convert a generated ~2 GB HF checkpoint and measure time and memory.

    python tools/bench_convert.py [--gib 2] [--keep DIR] [--fp8]

Writes a random Qwen3-architecture checkpoint (bf16, written tensor by tensor; with ``--fp8``
its linear weights as released FP8: e4m3 + float32 weight_scale_inv per 128x128 block and
quantization_config), then runs ``import_hf`` in a fresh process (FP8: dequantised to bf16).
The last line is ``peak_rss_mib=X largest_tensor_mib=Y seconds=Z`` where X is the conversion's
peak resident memory above the process's baseline after its imports (python + torch, printed
on the line before), so X measures what the conversion holds, which streaming bounds by the
largest tensor rather than the model; Y is the largest tensor's bf16 size. With ``--fp8`` a
line before it says whether X <= Y + 512 MiB (the bound docs/conversion.md states).
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CHILD = r"""
import gc, json, sys, time
import torch
from megamoe.convert import import_hf
from megamoe.diagnostics.memory import peak_rss_mib, reset_peak, rss_mib
import megamoe.convert.families  # all imports done before the baseline is read
gc.collect()
reset_peak()  # the peak restarts from the current RSS
base = rss_mib()
start = time.time()
import_hf(sys.argv[1], sys.argv[2], progress=False)
seconds = time.time() - start
print(json.dumps({"baseline_rss_mib": base, "peak_rss_mib": peak_rss_mib(), "seconds": seconds}))
"""


def qwen3_config(gib: float) -> dict:
    """A Qwen3 config of about ``gib`` GiB in bf16 (24 layers, vocab 64k)."""
    hidden, layers = 2048, 24
    per_layer = hidden * (2048 + 2 * 512) + 2048 * hidden + 3 * hidden * 8192
    vocab = 64000
    total = layers * per_layer + 2 * vocab * hidden
    layers = max(1, round(layers * (gib * 2**30 / 2 - 2 * vocab * hidden) / (total - 2 * vocab * hidden)))
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 8192, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "max_position_embeddings": 4096, "dtype": "bfloat16"}


def write_hf(out: Path, config: dict, fp8: bool = False) -> int:
    """Random weights written one tensor at a time; returns the largest tensor's bf16 bytes."""
    from megamoe.convert.families.qwen3 import config_from_hf, rules
    from megamoe.checkpoint.hf_io import write_hf_dir
    from megamoe.convert.table import expand
    from megamoe.convert.api import build_model, model_tensors

    cfg = config_from_hf(config)
    with torch.device("meta"):
        meta = model_tensors(build_model(cfg, device="meta"))
    planned = []
    for e in expand(rules(cfg, config), cfg, config):
        outs = e.to_hf(torch.empty(meta[e.mm].shape, device="meta"))
        planned += [(n, torch.bfloat16, tuple(t.shape)) for n, t in zip(e.hf, outs)]
    gen = torch.Generator().manual_seed(0)
    stream = ((n, torch.randn(s, generator=gen).mul_(0.02).to(torch.bfloat16)) for n, _, s in planned)
    largest = max(torch.Size(s).numel() * 2 for _, _, s in planned)
    if fp8:  # the linear weights of the layers as an FP8 release holds them
        from megamoe.convert.quant import QuantFormat, fp8_plan, fp8_stream

        fmt = QuantFormat((128, 128))
        planned, quantised = fp8_plan(planned, fmt, None)
        stream = fp8_stream(stream, quantised, fmt)
        config = {**config, "quantization_config": fmt.config()}
    write_hf_dir(out, config, planned, stream, shard_bytes=1 << 30)
    return largest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="checkpoint size to generate")
    p.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    p.add_argument("--fp8", action="store_true", help="the checkpoint in the FP8 release format (dequantised on import)")
    args = p.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench_convert_"))
    hf_dir, out = work / "hf", work / "megamoe"
    largest = write_hf(hf_dir, qwen3_config(args.gib), args.fp8)
    size = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    print(f"generated {size / 2**30:.2f} GiB {'FP8 ' if args.fp8 else ''}HF checkpoint in {hf_dir}")
    res = json.loads(subprocess.run([sys.executable, "-c", CHILD, str(hf_dir), str(out)], check=True,
                                    capture_output=True, text=True).stdout.strip().splitlines()[-1])
    print(f"baseline_rss_mib={res['baseline_rss_mib']:.0f} (python + torch after imports) "
          f"absolute_peak_rss_mib={res['peak_rss_mib']:.0f}")
    if not args.keep:
        import shutil

        shutil.rmtree(work)
    peak = res['peak_rss_mib'] - res['baseline_rss_mib']
    if args.fp8:
        bound = largest / 2**20 + 512
        print(f"FP8 import: peak {peak:.0f} MiB {'<=' if peak <= bound else '>'} largest bf16 tensor + 512 MiB "
              f"= {bound:.0f} MiB")
    print(f"peak_rss_mib={peak:.0f} largest_tensor_mib={largest / 2**20:.0f} seconds={res['seconds']:.1f}")


if __name__ == "__main__":
    main()
