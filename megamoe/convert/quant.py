"""Quantised HF checkpoints: the FP8 formats released models ship, read and written.

DeepSeek-V3.x, Kimi-K2.x, MiniMax-M2 and the FP8 editions of GLM-5 and Qwen3.x store each
linear weight ``X.weight`` as e4m3 with a float32 ``X.weight_scale_inv`` (a tensor without the
``.weight`` suffix, such as a stacked ``experts.gate_up_proj``, has ``X_scale_inv``) and
declare it in config.json::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                            "activation_scheme": "dynamic"}

Block scaling: weight [..., N, K] and scale [..., ceil(N/bn), ceil(K/bk)]; block (i, j) covers
rows i*bn .. min((i+1)*bn, N) and columns j*bk .. min((j+1)*bk, K), so the last block of a
dimension that is not a multiple of the block is a padded, partial one (DeepSeek's
``weight_dequant``, transformers' ``_dequantize_fp8_weight``). The dequantised value is
``float32(q) * scale`` rounded once to the output dtype. Without ``weight_block_size`` the
scale is per tensor (``[]`` or ``[1]``) or per output row (``[N]`` or ``[N, 1]``).

Everything else (``ue8m0`` scales, static activation scales, other ``quant_method`` values,
an F8 tensor without its scale) is refused with one line naming the tensor or field.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from megamoe.core.errors import CheckpointError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
FP8_DTYPES = frozenset({"F8_E4M3"})   # safetensors codes of the values a format here dequantises
SCALE_DTYPES = frozenset({"F32", "BF16", "F16"})


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's FP8 format: ``block`` (bn, bk) or None for per-tensor / per-row scales."""

    block: tuple[int, int] | None = (128, 128)

    def config(self) -> dict:
        """The ``quantization_config`` this format writes (DeepSeek's own keys)."""
        out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        return out | ({"weight_block_size": list(self.block)} if self.block else {})

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The block scale grid of a weight ``shape`` [..., N, K]."""
        bn, bk = self.block
        return (*shape[:-2], math.ceil(shape[-2] / bn), math.ceil(shape[-1] / bk))


def quant_format(hf: dict, source: str) -> QuantFormat | None:
    """The FP8 format ``config.json`` declares (None: not quantised); any other is one line."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where} must be a mapping, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{where}.quant_method={method!r} is not supported (megamoe reads fp8: e4m3 weights "
                              f"with float scales); dequantise the checkpoint first")
    checks = (("fmt", qc.get("fmt", "e4m3"), ("e4m3", "float8_e4m3fn")),
              ("scale_fmt", qc.get("scale_fmt") or "float", ("float",)),
              ("activation_scheme", qc.get("activation_scheme", "dynamic"), ("dynamic",)))
    for key, value, allowed in checks:
        if value not in allowed:
            raise CheckpointError(f"{where}.{key}={value!r} is not supported (allowed: {', '.join(allowed)})")
    block = qc.get("weight_block_size")
    if block is None:
        return QuantFormat(None)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}.weight_block_size={block!r} must be two positive integers")
    return QuantFormat(tuple(block))


def scale_name(name: str) -> str:
    """The scale tensor of a quantised HF tensor (transformers' naming)."""
    return name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def scale_owner(name: str) -> str | None:
    """The quantised tensor a scale name belongs to (None: not a scale)."""
    if name.endswith(".weight_scale_inv"):
        return name[: -len("_scale_inv")]
    return name[: -len("_scale_inv")] if name.endswith("_scale_inv") else None


def check_scale(fmt: QuantFormat, name: str, shape: tuple, scale: str, scale_shape: tuple, source: str) -> None:
    """The scale's shape fits the weight's under ``fmt`` (from headers, before any reading)."""
    if fmt.block is not None:
        want = fmt.scale_shape(shape)
        ok = len(shape) >= 2 and tuple(scale_shape) == want
    else:
        n = shape[-2] if len(shape) >= 2 else 1
        ok = tuple(scale_shape) in ((), (1,), (n,), (n, 1), (*shape[:-2], n, 1))
        want = f"[], [1] or [{n}]"
    if not ok:
        raise CheckpointError(f"{source}: scale {scale} has shape {list(scale_shape)}, {name} "
                              f"{list(shape)} needs {list(want) if isinstance(want, tuple) else want}")


def row_scales(fmt: QuantFormat, q_shape: tuple, scale: torch.Tensor) -> torch.Tensor:
    """The scale as [..., N, C]: one row per weight row, C column blocks (1 without blocks)."""
    scale = scale.float()
    if fmt.block is None:
        target = (*q_shape[:-2], q_shape[-2], 1)
        return scale.reshape(-1)[0].expand(target) if scale.numel() == 1 else scale.reshape(target)
    return scale.repeat_interleave(fmt.block[0], dim=-2)[..., : q_shape[-2], :]


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``q`` [..., N, K] times its scale -> [..., N, K] ``dtype``, one row block at a time
    (the fp32 temporary is one block of rows, the output the only full-size tensor)."""
    if q.dim() < 2:
        return (q.float() * scale.float().reshape(-1)[0]).to(dtype)
    n, k = q.shape[-2:]
    rows = row_scales(fmt, q.shape, scale)                       # [..., N, C]
    width = fmt.block[1] if fmt.block is not None else k
    out = torch.empty(q.shape, dtype=dtype)
    step = fmt.block[0] if fmt.block is not None else max(1, (1 << 22) // max(k, 1))
    for i in range(0, n, step):
        s = rows[..., i:i + step, :].repeat_interleave(width, dim=-1)[..., :k]   # [..., rows, K]
        out[..., i:i + step, :] = (q[..., i:i + step, :].float() * s).to(dtype)
    return out


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], float32 scale [..., ceil(N/bn), ceil(K/bk)]) with
    scale = amax(block) / 448 (DeepSeek's ``weight_quant``; an all-zero block gets scale 1), so
    ``dequantize`` gives w back to e4m3 precision. Padded edge blocks take the amax of the rows
    and columns they hold."""
    bn, bk = block
    n, k = w.shape[-2:]
    lead = w.shape[:-2]
    rn, rk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(*lead, rn * bn, rk * bk, dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    tiles = padded.view(*lead, rn, bn, rk, bk)
    amax = tiles.abs().amax(dim=(-3, -1))                           # [..., rn, rk]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(*lead, rn * bn, rk * bk)[..., :n, :k].contiguous(), scale.float()


class DequantizedHF:
    """An HF checkpoint (``HFCheckpoint``) seen with its FP8 weights dequantised: the scale
    tensors are consumed (not in ``names``), ``dtypes`` gives an FP8 tensor as ``dtype``, and
    ``tensor(name)`` reads and dequantises one tensor (``raw(name)``: its e4m3 values and scale).

    Every check runs on the headers, before a byte is read: each F8 tensor has its scale of the
    right shape and dtype, each scale its tensor, and the family converts FP8 (``weight_dtypes``)."""

    def __init__(self, ck, fmt: QuantFormat, dtype: torch.dtype, family):
        self.ck, self.fmt, self.dtype = ck, fmt, dtype
        self.path, self.config, self.files = ck.path, ck.config, ck.files
        src = str(ck.path)
        self.scales = {}
        for name, code in ck.dtypes.items():
            if code not in FP8_DTYPES:
                continue
            if code not in family.weight_dtypes:
                raise CheckpointError(f"{src}: tensor {name} is {code}; {family.model_type} does not convert FP8 "
                                      f"weights (megamoe-convert families lists those that do)")
            scale = scale_name(name)
            if scale not in ck.shapes:
                raise CheckpointError(f"{src}: tensor {name} is {code} without its scale {scale} (fp8 format "
                                      f"{fmt.config()})")
            if ck.dtypes[scale] not in SCALE_DTYPES:
                raise CheckpointError(f"{src}: scale {scale} is {ck.dtypes[scale]} (expected one of "
                                      f"{', '.join(sorted(SCALE_DTYPES))})")
            check_scale(fmt, name, ck.shapes[name], scale, ck.shapes[scale], src)
            self.scales[name] = scale
        owned = set(self.scales.values())
        for name in ck.shapes:
            if scale_owner(name) is not None and name not in owned:
                raise CheckpointError(f"{src}: scale {name} belongs to no FP8 tensor ({scale_owner(name)} is "
                                      f"{ck.dtypes.get(scale_owner(name), 'missing')})")
        code = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
        self.shapes = {n: s for n, s in ck.shapes.items() if n not in owned}
        self.dtypes = {n: (code if n in self.scales else ck.dtypes[n]) for n in self.shapes}

    @property
    def names(self) -> set[str]:
        return set(self.shapes)

    def raw(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 values, scale as stored) of an FP8 tensor."""
        return self.ck.tensor(name), self.ck.tensor(self.scales[name])

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.scales:
            return self.ck.tensor(name)
        return dequantize(*self.raw(name), self.fmt, self.dtype)

    def largest_bytes(self) -> int:
        return self.ck.largest_bytes()


# ---- which HF tensors a release quantises ------------------------------------------------------

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")
# without a record of the original: the linear weights of the layers, as DeepSeek and MiniMax
# ship them (not the norms, the router, DeepSeek-V3.2's indexer head weights)
_UNQUANTISED = re.compile(r"norm|\.gate\.weight$|weights_proj|e_score_correction_bias|_bias$|\.bias$")


def name_pattern(name: str) -> str:
    """``model.layers.3.mlp.experts.17.up_proj.weight`` -> ``model.layers.*.mlp.experts.*.up_proj.weight``."""
    return _INDEX.sub("*", name)


def fp8_record(ck) -> dict:
    """What an import keeps of an FP8 checkpoint's format: the block and which tensors were FP8
    (as name patterns), so an export writes the same tensors in FP8."""
    return {"block": list(ck.fmt.block) if ck.fmt.block else None,
            "tensors": sorted({name_pattern(n) for n in ck.scales})}


def quantised_in_release(name: str, shape: tuple, record: dict | None) -> bool:
    """Whether an export with FP8 blocks writes HF tensor ``name`` as FP8: as the original
    checkpoint had it (``record``), else every linear weight of the layers."""
    if record is not None:
        return name_pattern(name) in set(record["tensors"])
    return len(shape) >= 2 and ".layers." in name and not _UNQUANTISED.search(name)


def fp8_plan(planned: list[tuple[str, torch.dtype, tuple]], fmt: QuantFormat, record: dict | None
             ) -> tuple[list[tuple[str, torch.dtype, tuple]], set[str]]:
    """An export's (name, dtype, shape) plan with the tensors the release quantises as e4m3 plus
    their float32 scales right after them; returns it and the quantised names."""
    out, quantised = [], set()
    for name, dtype, shape in planned:
        if dtype.is_floating_point and quantised_in_release(name, shape, record):
            quantised.add(name)
            out += [(name, E4M3, shape), (scale_name(name), torch.float32, fmt.scale_shape(shape))]
        else:
            out.append((name, dtype, shape))
    return out, quantised


def fp8_stream(tensors, quantised: set[str], fmt: QuantFormat):
    """(name, tensor) pairs with the ``quantised`` ones as (name, e4m3), (scale name, scale);
    a tensor given as (e4m3, block scales) already is written as it is."""
    for name, t in tensors:
        if name in quantised:
            q, s = t if isinstance(t, tuple) else quantize_blocks(t, fmt.block)
            yield name, q
            yield scale_name(name), s
        else:
            yield name, t


def set_quantization_config(config: dict, fmt: QuantFormat | None) -> None:
    """config.json declares ``fmt`` (None: unquantised, so an original's declaration goes)."""
    config.pop("quantization_config", None)
    if fmt is not None:
        config["quantization_config"] = fmt.config()
