"""Measure what one image costs in a vision encoder: patches, LM tokens, activation memory.

Activation memory is the bytes autograd keeps for backward (saved tensors, each storage
counted once), measured on one encoder block at the real width and scaled by the depth, so
even a 400M-parameter tower is measured on a CPU in seconds. Example:

    python tools/vision_memory.py --encoder qwen3_vit_416m_enc --sizes 448x448 896x896 1344x1344
"""
from __future__ import annotations

import argparse

import torch

from megamoe.core.config import VisionConfig
from megamoe.core.dtypes import DTYPES
from megamoe.diagnostics.memory import saved_tensor_bytes
from megamoe.vision import VisionTower



def measure(encoder: str, depth_arg: str, sizes, dtype: torch.dtype, projector: str, merge: int):
    one = VisionTower(VisionConfig(encoder=encoder, encoder_args={depth_arg: 1}, projector=projector,
                                   merge_size=merge, image_token_id=0), out_dim=8, dtype=dtype)
    with torch.device("meta"):  # shapes only: depth and parameter count of the real tower
        full_depth = VisionTower(VisionConfig(encoder=encoder, projector=projector, merge_size=merge,
                                              image_token_id=0), out_dim=8)
    depth = len(getattr(full_depth.encoder.model, "blocks"))
    params = sum(p.numel() for p in full_depth.encoder.parameters())
    print(f"{encoder}: {params / 1e6:.0f}M encoder parameters, depth {depth}, width {one.encoder.dim}, "
          f"patch {one.encoder.reduction}, {projector} projector, {str(dtype).split('.')[-1]}")
    print(f"{'image':>11} {'patches':>8} {'LM tokens':>9} {'act/layer MiB':>13} {'act total MiB':>13} "
          f"{'bytes/patch/layer/width':>23}")
    for h, w in sizes:
        x = torch.randn(1, 3, h, w, dtype=dtype)
        patches = (h // one.encoder.reduction) * (w // one.encoder.reduction)
        stem = saved_tensor_bytes(lambda: one.encoder.model.patch_embed(x), one.parameters())[0]
        per_layer = saved_tensor_bytes(lambda: one.encoder(x)[0], one.parameters())[0] - stem
        print(f"{h:>5}x{w:<5} {patches:>8} {one.num_tokens(h, w):>9} {per_layer / 2**20:>13.1f} "
              f"{per_layer * depth / 2**20:>13.0f} {per_layer / patches / one.encoder.dim:>23.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoder", default="qwen3_vit_416m_enc")
    ap.add_argument("--depth-arg", default="depth", help="timm kwarg that sets the number of blocks")
    ap.add_argument("--sizes", nargs="+", default=["448x448", "896x896"], help="HxW, multiples of the patch grid")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--projector", choices=["mlp", "merger"], default="merger")
    ap.add_argument("--merge-size", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    measure(args.encoder, args.depth_arg, sizes, DTYPES[args.dtype], args.projector, args.merge_size)


if __name__ == "__main__":
    main()
