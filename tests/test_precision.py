"""Per-layer precision report: a model with one deliberately perturbed layer is named at that
layer (earlier layers exactly equal, routing agreement 1 before it); the command prints the
table for fp32/bf16 and against transformers, and writes the PNG."""
from __future__ import annotations

import pytest
import torch

from megamoe.diagnostics.precision import capture, compare, first_past
from megamoe.layers.backends.local import LocalBackend
from megamoe.parallel.linear import RowParallelLinear


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


# ---- kernel precision: a planted wrong kernel is named by layer ---------------------------------


class ScaledRowLinear(RowParallelLinear):
    """A row-parallel linear as a scaled GEMM: x and W divided by their absmax scales, multiplied,
    and the product rescaled (exact up to rounding) -- unless ``bad``, where the rescale is off
    by 1%: the kind of wrong kernel a precision report has to find."""

    bad = False

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        sx, sw = x.abs().amax().clamp(min=1e-12), self.weight.abs().amax()
        y = torch.nn.functional.linear(x / sx, self.weight / sw)
        return y * (sx * sw * (1.01 if self.bad else 1.0))


class ScaledGemmBackend(LocalBackend):
    """``local`` with every row-parallel GEMM scaled, and a bad scale in layer BAD's shared expert."""

    name = "scaled_gemm"
    row_cls = ScaledRowLinear
    BAD = 1

    def shared_expert(self, ctx, cfg, layer_number: int = 0):
        expert = super().shared_expert(ctx, cfg, layer_number)
        expert.linear_fc2.bad = layer_number == self.BAD
        return expert


@pytest.fixture
def scaled_gemm_backend():
    from megamoe.layers import backends

    backends.register_backend("scaled_gemm", ScaledGemmBackend)
    yield
    backends._REGISTRY.pop("scaled_gemm")


def test_kernel_precision_names_the_planted_layer_first(tmp_path, capsys, scaled_gemm_backend):
    """``megamoe-precision --streamed --backend scaled_gemm`` against the fp64 ``local`` reference:
    layer 1 (whose shared expert's GEMM has the bad scale) is the first past tolerance on its own
    input; the correct scaled GEMMs of layers 0 and 2 stay at fp32 rounding."""
    from megamoe.commands.precision import main
    from tests.test_convert_qwen import tiny_qwen3_next

    hf_dir = tmp_path / "hf"
    tiny_qwen3_next().save_pretrained(hf_dir)
    main([str(hf_dir), "--streamed", "--backend", "scaled_gemm", "--dtypes", "fp32", "--reference-dtype", "fp64",
          "--tolerance", "1e-4", "--prompt-len", "8"])
    out = capsys.readouterr().out.splitlines()
    name = "fp32 scaled_gemm vs local fp64 (own input)"
    assert f"{name}: first layer past tolerance 1e-04: 1 (Ae)" in out, "\n".join(out)
    rows = [line[len(name) + 1:].split() for line in out if line.startswith(name + ":")]
    errors = [float(r[3]) for r in rows if r[0].isdigit()]  # index mixer mlp rel_err cosine routing
    assert errors[0] < 1e-6 and errors[2] < 1e-6 and errors[1] > 1e-3, errors


def test_kernel_flags_need_streamed(tmp_path):
    from megamoe.commands.precision import main
    from megamoe.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--backend: the kernel comparison reads the model layer by layer"):
        main([str(tmp_path), "--backend", "cpu"])
