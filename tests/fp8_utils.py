"""FP8 checkpoints made as the released ones are (tests/test_convert_fp8.py, tests/test_fp8_base.py).

``quantize_like_release`` rewrites a saved HF checkpoint the way DeepSeek-V3.x and MiniMax-M2
ship theirs: every linear weight of the decoder layers e4m3 with a float32 ``weight_scale_inv``
per 128x128 block (edge blocks padded: ``ceil(N/128) x ceil(K/128)`` scales), the embedding,
the output layer, the norms, the router and its bias as they were, and config.json's
``quantization_config``. The quantiser is written here block by block, independently of
megamoe's (``megamoe.convert.quant.quantize_blocks``, which a test holds to it).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = 128
E4M3_MAX = 448.0
RELEASE_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK],
                  "activation_scheme": "dynamic"}
# what stays unquantised in the releases: the router (DeepSeek's mlp.gate, MiniMax's
# block_sparse_moe.gate), DeepSeek-V3.2's indexer head weights, anything outside the layers
KEEP = re.compile(r"(\.gate\.weight|\.weights_proj\.weight)$")


def quantize_block_by_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 [ceil(N/128), ceil(K/128)]) with scale = amax / 448
    per block, as DeepSeek's ``weight_quant`` does (all-zero block: scale 1)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(n / BLOCK), math.ceil(k / BLOCK))
    for i in range(scale.size(0)):
        for j in range(scale.size(1)):
            tile = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            amax = tile.abs().max()
            s = amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (tile / s).clamp(-448, 448).to(q.dtype)
    return q, scale


def is_released_fp8(name: str, t: torch.Tensor) -> bool:
    return (t.dim() == 2 and name.endswith(".weight") and ".layers." in name and "norm" not in name
            and not KEEP.search(name))


def quantize_like_release(src: Path, dst: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Write ``dst`` as the FP8 release of the per-expert (hub layout) checkpoint ``src``;
    returns {name: (e4m3, scale)} of the quantised tensors."""
    dst.mkdir(parents=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    out, quantised = {}, {}
    for name, t in tensors.items():
        if is_released_fp8(name, t):
            q, s = quantize_block_by_block(t)
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, s
            quantised[name] = (q, s)
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(RELEASE_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return quantised


def dequantized_like_transformers(fp8_dir: Path, out: Path):
    """The FP8 checkpoint as transformers' FP8 linears dequantise it (``_dequantize_fp8_weight``:
    128-blocks, padded edges cut off), written in float32 to ``out`` and loaded by transformers."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    stored = load_file(fp8_dir / "model.safetensors")
    state = {}
    for name, t in stored.items():
        if not name.endswith("weight_scale_inv"):
            scale = stored.get(name[:-len("weight")] + "weight_scale_inv")
            state[name] = t.float() if scale is None else _dequantize_fp8_weight(t, scale, [BLOCK, BLOCK], torch.float32)
    out.mkdir(parents=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config | {"dtype": "float32"}, indent=2))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
