"""Layer-streamed comparison against transformers (``megamoe-verify --streamed``): its per-layer
figures equal the whole-model comparison's on a tiny Qwen3-Next; a 3.5 GiB (fp32) model is
compared in a fresh process whose peak RSS stays within 1 GiB of the interpreter's; at
TP=2 x EP=2 x PP=2 (4 gloo ranks, what torchrun starts) each stage's first rank compares the
layers that live there, with the single process's figures."""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist import REPO


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.test_convert_qwen import tiny_qwen3_next

    path = tmp_path_factory.mktemp("qwen3_next") / "hf"
    tiny_qwen3_next().save_pretrained(path)
    return str(path)


def whole_model_rows(hf_dir: str):
    """The whole-model comparison (``megamoe-precision --reference hf``): fp32 megamoe's hidden
    states against transformers', the last layer's after the final norm."""
    from megamoe.commands.precision import hf_comparison
    from megamoe.convert import from_hf
    from megamoe.diagnostics.precision import capture, compare
    from megamoe.diagnostics.validate import prompt_ids

    model = from_hf(hf_dir)
    ids = prompt_ids(model.config, 2, 12, 0)
    ours, theirs = hf_comparison(model, hf_dir, ids, capture(model, ids))
    return compare(theirs, ours, model.config.parsed_layout())


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def test_streamed_figures_equal_the_whole_model_comparison(hf_dir):
    from megamoe.diagnostics.validate import streamed_reports, verdict

    report = streamed_reports(hf_dir, {"megamoe": {}})["megamoe"]
    whole = whole_model_rows(hf_dir)
    assert [(r.index, r.mixer, r.mlp) for r in report.chain] == [(0, "G", "e"), (1, "A", "e"), (2, "G", "d")]
    for s, w in zip(report.chain[:-1], whole[:-1]):  # chained: what the whole-model run sees
        assert close(s.rel_err, w.rel_err) and close(s.cosine, w.cosine), (s, w)
    rel, cos, logits = report.final  # the last layer after the final norm, as transformers reports it
    assert close(rel, whole[-1].rel_err) and close(cos, whole[-1].cosine)
    assert all(r.rel_err <= 1e-5 for r in report.local) and logits <= 1e-4
    assert [r.routing for r in report.local] == [1.0, 1.0, None]
    assert verdict(report, 1e-5, 1e-4)


# ---- a model three times the allowed peak -----------------------------------------------------


def write_tiled_safetensors(path: Path, shapes: dict, seed: int) -> None:
    """fp32 tensors of ``shapes`` written straight into a safetensors file: norm weights ones, every
    other tensor a 4 MiB random block followed by a file hole (zeros). Readers still bring each
    tensor in whole; only the disk is spared the gigabytes."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4 * shape.numel()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, shape in shapes.items():
            k = min(shape.numel(), 1 << 20)
            block = torch.ones(k) if name.endswith("norm.weight") else 0.02 * torch.randn(k, generator=g)
            f.write(block.numpy().tobytes())
            f.seek(4 * (shape.numel() - k), 1)
        f.truncate()


def write_wide_qwen3(path: Path, layers: int = 8, hidden: int = 1024, ffn: int = 36864) -> int:
    """A Qwen3 HF folder of few wide layers (one safetensors file per layer); its fp32 bytes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path.mkdir(parents=True)
    cfg = Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=64,
                      tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3ForCausalLM(cfg).state_dict().items()}
    files: dict[str, dict] = {}
    for name, shape in shapes.items():
        part = name.split(".")[2] if name.startswith("model.layers.") else "outer"
        files.setdefault(f"model-{part}.safetensors", {})[name] = shape
    for seed, (file, group) in enumerate(files.items()):
        write_tiled_safetensors(path / file, group, seed)
    index = {name: file for file, group in files.items() for name in group}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg.save_pretrained(path)
    return 4 * sum(s.numel() for s in shapes.values())


MEASURED = """
import contextlib, io, json, sys
import transformers, megamoe.commands.verify, megamoe.diagnostics.validate, megamoe.diagnostics.hf_reference
from transformers import Qwen3ForCausalLM
from megamoe.diagnostics.memory import peak_rss_mib, rss_mib
base, out, code = rss_mib(), io.StringIO(), 0
with contextlib.redirect_stdout(out):
    try:
        megamoe.commands.verify.main([sys.argv[1], "--streamed", "--prompt-len", "8"])
    except SystemExit as e:
        code = e.code
print(json.dumps({"base": base, "peak": peak_rss_mib(), "code": code, "out": out.getvalue()}))
"""


def test_streamed_verify_of_a_model_three_times_the_allowed_peak(tmp_path):
    """``megamoe-verify --streamed`` on 3.5 GiB of fp32 weights: OK, every layer reported, and the
    process's peak RSS at most 1 GiB above the interpreter with its libraries imported."""
    weights = write_wide_qwen3(tmp_path / "hf")
    allowed_mib = 1024
    assert weights >= 3 * allowed_mib * 2**20
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-c", MEASURED, str(tmp_path / "hf")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    lines = got["out"].splitlines()
    assert got["code"] == 0 and lines[-1] == "OK", got["out"]
    rows = [line.split("(own input):")[1].split() for line in lines if "(own input):" in line]
    rows = [r for r in rows if r[0].isdigit()]  # index mixer mlp rel_err cosine routing
    assert [r[0] for r in rows] == [str(i) for i in range(8)] and all(float(r[3]) <= 1e-5 for r in rows), rows
    assert got["peak"] - got["base"] <= allowed_mib, {k: got[k] for k in ("base", "peak")}


# ---- at a layout --------------------------------------------------------------------------------


def streamed_at(hf_dir: str, layout: dict):
    """On every rank: this rank's stage compared (its first rank reports)."""
    from megamoe.core.config import ParallelConfig
    from megamoe.diagnostics.validate import streamed_reports
    from megamoe.inference.distributed import inference_groups

    groups = inference_groups(ParallelConfig(**layout))
    reports = streamed_reports(hf_dir, {"megamoe": {}}, groups=groups)
    return None if reports is None else reports["megamoe"]


def test_streamed_at_tp2_ep2_pp2_equals_one_process(pool, hf_dir):
    from megamoe.diagnostics.validate import streamed_reports

    single = streamed_reports(hf_dir, {"megamoe": {}})["megamoe"]
    results = pool(4).run(streamed_at, hf_dir, dict(tp=2, ep=2, pp=2))
    reporting = [r for r in results if r is not None]
    assert len(reporting) == 2  # one per pipeline stage
    first, last = sorted(reporting, key=lambda r: r.local[0].index)
    assert [r.index for r in first.local] == [0, 1] and [r.index for r in last.local] == [2]
    assert first.final is None
    rows = first.local + last.local, first.chain + last.chain
    for got, want in zip(rows, (single.local, single.chain)):
        for g, w in zip(got, want):
            assert abs(g.rel_err - w.rel_err) <= 1e-6 and g.routing == w.routing and g.rel_err <= 1e-5, (g, w)
    assert abs(last.final[0] - single.final[0]) <= 1e-6 and last.final[2] <= 1e-4
