"""Importing an FP8 release with its weights kept in FP8 (``import-hf --keep-fp8``,
``from_hf(keep_fp8=True)``; the model side is ``megamoe.model.fp8_base``).

A megamoe weight stays e4m3 when it is the weight of a linear or routed-experts role and its
mapping rule, run on the HF e4m3 values (as bytes) and on their scales repeated over rows
([..., N, C], ``megamoe.convert.quant.row_scales``), gives the model's shape for both: rules
that move whole rows (renames, gate|up concatenation, per-KV-group QKV fusion, expert stacks)
do; a rule that mixes columns or joins an FP8 tensor with a float one does not, and such a
weight is dequantised as in a plain import. The check runs on meta tensors, before any read.
"""
from __future__ import annotations

import math

import torch

from megamoe.core.config import Fp8BaseConfig
from megamoe.convert.quant import E4M3, DequantizedHF, row_scales
from megamoe.convert.table import Entry
from megamoe.core.errors import CheckpointError
from megamoe.model.fp8_base import fp8_candidates


def _sources(ck: DequantizedHF, e: Entry, fp8, other) -> list[torch.Tensor]:
    return [fp8(n) if n in ck.scales else other(n) for n in e.hf]


def _keeps(ck: DequantizedHF, e: Entry, shape: tuple, block_cols: int) -> bool:
    """Whether ``e``'s rule carries e4m3 rows and their scales into ``shape`` (meta tensors)."""
    meta = lambda s, dtype: torch.empty(s, dtype=dtype, device="meta")  # noqa: E731
    try:
        q = e.to_mm(_sources(ck, e, lambda n: meta(ck.shapes[n], torch.uint8),
                             lambda n: meta(ck.shapes[n], torch.float32)))
        cols = lambda n: math.ceil(ck.shapes[n][-1] / block_cols)  # noqa: E731
        s = e.to_mm(_sources(ck, e, lambda n: meta((*ck.shapes[n][:-1], cols(n)), torch.float32),
                             lambda n: meta(ck.shapes[n], torch.float32)))
    except Exception:  # noqa: BLE001  (a transform that cannot take the scales keeps the weight float)
        return False
    return (q.dtype == torch.uint8 and tuple(q.shape) == shape
            and tuple(s.shape) == (*shape[:-1], math.ceil(shape[-1] / block_cols)))


def plan_fp8_base(ck, entries: list[Entry], meta_model) -> Fp8BaseConfig:
    """Which of the model's weights an import keeps in FP8 (see the module docstring)."""
    if not isinstance(ck, DequantizedHF) or not ck.scales:
        raise CheckpointError(f"{ck.path}: --keep-fp8 needs an FP8 checkpoint (config.json has no fp8 "
                              f"quantization_config or no F8_E4M3 tensors)")
    if ck.fmt.block is None:
        raise CheckpointError(f"{ck.path}: --keep-fp8 keeps block-scaled FP8 (weight_block_size); this checkpoint's "
                              f"scales are per tensor or per row: import it without --keep-fp8")
    shapes = {n: tuple(t.shape) for n, t in meta_model.state_dict().items()}
    candidates = fp8_candidates(meta_model)
    kept = [e.mm for e in entries if e.mm in candidates and any(n in ck.scales for n in e.hf)
            and _keeps(ck, e, shapes[e.mm], ck.fmt.block[1])]
    return Fp8BaseConfig(block=list(ck.fmt.block), tensors=sorted(kept))


def fp8_producer(ck: DequantizedHF, by_name: dict[str, Entry], base: Fp8BaseConfig):
    """``produce(name)`` for the kept weights and their ``_scale`` tensors (None for any other)."""
    kept = set(base.tensors)

    def produce(name: str) -> torch.Tensor | None:
        if name in kept:
            e = by_name[name]
            return e.to_mm(_sources(ck, e, lambda n: ck.raw(n)[0].view(torch.uint8), ck.tensor)).view(E4M3)
        owner = name[: -len("_scale")]
        if name.endswith("_scale") and owner in kept:
            e = by_name[owner]
            return e.to_mm(_sources(ck, e, lambda n: row_scales(ck.fmt, ck.shapes[n], ck.raw(n)[1]), ck.tensor))
        return None

    return produce


# ---- exporting kept weights -------------------------------------------------------------------

def split_fp8(shapes_dtypes: dict) -> tuple[dict, set[str]]:
    """(the model tensors an export maps, a kept weight listed as float; the kept weights'
    names) from {name: (shape, dtype)} holding kept weights (e4m3) and their ``_scale``s."""
    kept = {n for n, (_, dtype) in shapes_dtypes.items() if dtype == E4M3}
    out = {n: (shape, torch.float32 if n in kept else dtype) for n, (shape, dtype) in shapes_dtypes.items()
           if not (n.endswith("_scale") and n[: -len("_scale")] in kept)}
    return out, kept


def _blocks(rows: torch.Tensor, block_rows: int) -> torch.Tensor | None:
    """Row scales [..., N, C] back to the block grid [..., ceil(N/bn), C], or None when the rows
    of a block differ (the weight is not the release's blocks any more)."""
    grid = rows[..., ::block_rows, :]
    same = torch.equal(grid.repeat_interleave(block_rows, dim=-2)[..., : rows.size(-2), :], rows)
    return grid.contiguous() if same else None


def kept_to_hf(e: Entry, q: torch.Tensor, rows: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
               fmt, quantised: set[str]) -> list:
    """The HF tensors of kept weight ``e.mm`` (e4m3 ``q``, ``rows`` [..., N, C] scales): as the
    release's e4m3 values and block scales, bit for bit, when the export writes FP8 in the same
    blocks; else dequantised (``dtype``)."""
    if fmt is not None and fmt.block == tuple(block) and all(n in quantised for n in e.hf):
        values = e.to_hf(q.view(torch.uint8))
        scales = [_blocks(s, block[0]) for s in e.to_hf(rows)]
        if all(s is not None for s in scales):
            return [(v.view(E4M3).contiguous(), s) for v, s in zip(values, scales)]
    col_block = torch.arange(q.size(-1)) // block[1]
    return e.to_hf((q.float() * rows.index_select(-1, col_block)).to(dtype))
