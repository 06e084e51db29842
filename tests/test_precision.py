"""Per-layer precision report: a model with one deliberately perturbed layer is named at that
layer (earlier layers exactly equal, routing agreement 1 before it); the command prints the
table for fp32/bf16 and against transformers, and writes the PNG."""
from __future__ import annotations

import torch

from megamoe.diagnostics.precision import capture, compare, first_past


def qwen3_next_model():
    from megamoe.convert import build_model
    from megamoe.convert.family import get_family
    from megamoe.model.weights import initialize
    from tests.test_convert_qwen import qwen3_next_config

    hf = qwen3_next_config().to_dict()
    model = build_model(get_family("qwen3_next").config_from_hf(hf)).eval()
    initialize(model, model.groups, seed=0)
    return model  # layers Ge, Ae, Gd


def test_perturbed_layer_is_the_first_past_tolerance():
    import copy

    model = qwen3_next_model()
    bad = copy.deepcopy(model)
    with torch.no_grad():
        w = bad.layers["1"].mixer.linear_qkv.weight
        w.add_(0.05 * w.abs().mean() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    rows = compare(capture(model, ids), capture(bad, ids), model.config.parsed_layout())
    assert [(r.index, r.mixer, r.mlp) for r in rows] == [(0, "G", "e"), (1, "A", "e"), (2, "G", "d")]
    assert rows[0].rel_err == 0.0 and rows[0].cosine > 0.999999 and rows[0].routing == 1.0
    assert rows[2].routing is None  # a dense MLP has no routing
    assert first_past(rows, 1e-3).index == 1 and rows[1].rel_err > 1e-3


def test_precision_command_prints_the_table_and_plots(tmp_path, capsys):
    from PIL import Image

    from megamoe.commands.precision import main
    from tests.test_convert_qwen import tiny_qwen3_next

    hf_dir = tmp_path / "hf"
    tiny_qwen3_next().save_pretrained(hf_dir)
    png = tmp_path / "err.png"
    main([str(hf_dir), "--dtypes", "fp32,bf16", "--reference", "hf", "--plot", str(png), "--prompt-len", "8"])
    out = capsys.readouterr().out.splitlines()
    assert "fp32 vs fp32: first layer past tolerance 5e-02: none" in out
    hf_rows = [line.split() for line in out if line.startswith("fp32 vs transformers:") and line.split()[3].isdigit()]
    assert [r[3:6] for r in hf_rows] == [["0", "G", "e"], ["1", "A", "e"], ["2", "G", "d"]]
    assert all(float(r[6]) <= 1e-5 for r in hf_rows)  # fp32 megamoe == transformers per layer
    bf16 = [line for line in out if line.startswith("bf16 vs fp32:") and line.split()[3].isdigit()]
    assert len(bf16) == 3 and all(0 < float(line.split()[6]) < 0.5 for line in bf16)
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (640, 400)
