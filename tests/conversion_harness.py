"""The round trip every family is tested with (tests/test_convert_*.py):

HF tiny random model, saved per-expert (default) and stacked (save_original_format=False)
-> import_hf -> megamoe logits equal transformers' (fp32 max abs <= 1e-4)
-> export_hf -> transformers loads it with its Auto class -> logits equal again
-> greedy decoding of 16 tokens identical to transformers' generate.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megamoe.convert import export_hf, import_hf
from megamoe.diagnostics.verify import load_hf_model, verify
from megamoe.core.config_io import config_from_dict
from megamoe.checkpoint.dcp import load_checkpoint, read_meta

ATOL = 1e-4


def load_converted(path: Path):
    from megamoe.convert import build_model

    meta = read_meta(path)
    model = build_model(config_from_dict(meta["model"]))
    load_checkpoint(path, model.groups, [model], load_rng=False)
    return model.eval()


def save_both_layouts(hf_model, root: Path) -> list[Path]:
    """The two expert layouts transformers writes (identical for models without experts)."""
    per_expert, stacked = root / "hf_per_expert", root / "hf_stacked"
    hf_model.save_pretrained(per_expert)
    hf_model.save_pretrained(stacked, save_original_format=False)
    return [per_expert, stacked]


@torch.no_grad()
def check_round_trip(hf_model, root: Path, *, new_tokens: int = 16, layouts: bool = True) -> dict:
    """Run the whole round trip; returns the measured differences (asserted here too)."""
    hf_model = hf_model.float().eval()
    dirs = save_both_layouts(hf_model, root) if layouts else [root / "hf"]
    if not layouts:
        hf_model.save_pretrained(dirs[0])
    out = {}
    for hf_dir in dirs:
        ckpt = import_hf(hf_dir, root / f"{hf_dir.name}_megamoe", progress=False)
        model = load_converted(ckpt)
        report = verify(hf_dir, hf_model=hf_model, model=model, new_tokens=new_tokens, atol=ATOL)
        assert report.ok, f"{hf_dir.name}: {report}"
        back = export_hf(ckpt, root / f"{hf_dir.name}_back", progress=False)
        reloaded = load_hf_model(back)
        again = verify(back, hf_model=reloaded, model=model, new_tokens=new_tokens, atol=ATOL)
        assert again.ok, f"{hf_dir.name} exported: {again}"
        out[hf_dir.name] = (report.max_abs_logits, again.max_abs_logits)
    return out


@torch.no_grad()
def check_parallel_import(hf_model, root: Path, pool, vocab: int) -> None:
    """Import for TP=2, EP=2 and TP=2 x EP=2, run on two gloo ranks (``pool``: the session fixture)
    and export back: transformers' logits each time (worker: tests/test_convert_qwen.py)."""
    from tests.test_convert_qwen import LAYOUTS, parallel_case

    hf_model = hf_model.float().eval()
    hf_model.save_pretrained(root / "hf")
    for name, parallel in LAYOUTS.items():
        import_hf(root / "hf", root / name, progress=False, **parallel)
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    want = hf_model(input_ids=ids).logits
    for rank, errs in enumerate(pool(2).run(parallel_case, str(root), ids, want)):
        assert set(errs) == set(LAYOUTS) and max(errs.values()) <= ATOL, (rank, errs)
    exported = load_hf_model(root / "tp2ep2_hf_rank0")
    assert (exported(input_ids=ids).logits - want).abs().max() <= ATOL
