"""What ``megamoe-verify --streamed`` and ``megamoe-precision --streamed`` run: an HF folder's model
compared layer by layer (``megamoe.diagnostics.streamed``), each layer read from the checkpoint
only while it runs, so the model never has to fit one host.

Two references:

    hf      transformers' model of the folder (``hf_reference.MetaHF``), fp32: is the conversion
            right, and where does it first depart?
    local   megamoe itself on the ``local`` backend (pure torch) in fp32 or fp64: are the kernels a
            run uses (``backend``, ``dtype``, ``fp8``) right, layer by layer?

Every rank of a layout calls ``streamed_reports``; each pipeline stage's first rank compares that
stage's layers and gets the reports, the other ranks None.
"""
from __future__ import annotations

import torch

from megamoe.convert.api import HFWeights
from megamoe.diagnostics.streamed import StreamReport, StreamedModel, compare_streamed, reports
from megamoe.parallel.groups import ParallelGroups


def prompt_ids(cfg, batch: int, length: int, seed: int) -> torch.Tensor:
    """Random token ids [batch, length] (the same on every rank), kept off an image placeholder."""
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    placeholder = getattr(cfg, "image_token_id", None)
    if placeholder is not None:
        ids[ids == placeholder] = (placeholder + 1) % cfg.vocab_size
    return ids


def reference_of(weights: HFWeights, stage: tuple[int, int], reference: str, dtype: torch.dtype):
    """The reference model: transformers' (``hf``), or one process of megamoe's own on the
    ``local`` backend in ``dtype`` (``local``; this stage's layers only)."""
    if reference == "hf":
        from megamoe.diagnostics.hf_reference import MetaHF

        return MetaHF(weights)
    return StreamedModel(weights, ParallelGroups(), stage, backend="local", dtype=dtype)


def streamed_reports(hf_dir, candidates: dict[str, dict], *, groups: ParallelGroups | None = None,
                     reference: str = "hf", reference_dtype: torch.dtype = torch.float32, batch: int = 2,
                     prompt_len: int = 12, seed: int = 0) -> dict[str, StreamReport] | None:
    """One ``StreamReport`` per candidate (name -> ``StreamedModel`` keywords: ``backend``,
    ``dtype``, ``fp8``), each against ``reference`` on the same prompt; this rank's stage only."""
    groups = groups or ParallelGroups()
    weights = HFWeights(hf_dir)
    stage = (groups.rank("pp"), groups.size("pp"))
    ids = prompt_ids(weights.cfg, batch, prompt_len, seed)
    out = {}
    for name, kw in candidates.items():
        candidate = StreamedModel(weights, groups, stage, **kw)
        ref = reference_of(weights, stage, reference, reference_dtype) if reports(groups) else None
        out[name] = compare_streamed(candidate, ref, ids)
    return out if reports(groups) else None


def verdict(report: StreamReport, tol: float, atol: float) -> bool:
    """No layer past ``tol`` on its own input, and (last stage) logits within ``atol``."""
    from megamoe.diagnostics.precision import first_past

    return first_past(report.local, tol) is None and (report.final is None or report.final[2] <= atol)
