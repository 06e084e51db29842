"""The backend registry: how a backend is chosen, what an unknown or unavailable one says, the
registration point for new ones, and layers that ask roles instead of testing types."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megamoe.core.errors import ConfigError
from megamoe.layers import backends
from megamoe.layers.backends import LocalBackend, available_backends, get_backend, register_backend
from tests.mixer_utils import tiny_model


@pytest.fixture
def registry():
    """Registers test backends for one test and removes them afterwards."""
    before = dict(backends._REGISTRY)
    yield register_backend
    backends._REGISTRY.clear()
    backends._REGISTRY.update(before)


def test_auto_is_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("auto picks cuda where CUDA is present")
    assert get_backend("auto").name == "cpu"
    assert get_backend("local").name == "local" and get_backend("cpu").name == "cpu"
    assert {"local", "cpu"} <= set(available_backends())


def test_an_unknown_backend_is_one_line():
    from megamoe.model.language_model import LanguageModel

    with pytest.raises(ConfigError, match=r"^model.backend='tensorrt' is not a backend: allowed: auto, local, cpu, cuda, te$"):
        LanguageModel(tiny_model("Ad", backend="tensorrt"))
    with pytest.raises(ConfigError, match=r"model.backend"):
        tiny_model("Ad", backend="two words").validate()


def test_an_unavailable_backend_names_what_is_missing(registry):
    registry("fancy", LocalBackend, missing=lambda: "package fancy_kernels is not installed")
    assert "fancy" not in available_backends()
    with pytest.raises(ConfigError) as e:
        get_backend("fancy")
    assert str(e.value) == "model.backend='fancy' is unavailable here: package fancy_kernels is not installed"


def test_a_registered_backend_fills_the_roles(registry):
    """A new backend subclasses one that exists and overrides the roles it accelerates; a model
    built with its name asks it for every role."""
    from megamoe.model.language_model import LanguageModel

    asked = []

    class Counting(LocalBackend):
        name = "counting"

        def norm(self, ctx, dim, **kw):
            asked.append(dim)
            return super().norm(ctx, dim, **kw)

    registry("counting", Counting)
    model = LanguageModel(tiny_model("GdAd", backend="counting"))
    assert model.ctx.backend.name == "counting"
    assert len(asked) == 2 + 2 + 2 + 1 + 1  # two norms per layer, GDN's and attention's q/k norms, the final norm


LAYERS = Path(__file__).resolve().parents[1] / "layers"
LAYER_FILES = [p for p in LAYERS.rglob("*.py")
               if "backends" not in p.parts
               # op libraries the backends pick kernels from (probes of torch's grouped GEMM, FP8,
               # fla, the fused attention tiles' devices; the fusion policy's compiler probe, which
               # the backend instance owns)
               and p.relative_to(LAYERS).as_posix() not in ("ops/grouped_gemm.py", "ops/fp8/linear.py",
                                                           "ops/fp8/experts.py", "ops/fusion.py",
                                                           "ops/attention/tiles.py")]
FORBIDDEN = re.compile(r"__class__|\btype\([^)]*\)\s+is\b|Backend\b|[\"'](local|cpu|te|cuda)[\"']|\.device\.type|"
                       r"\.is_cuda|torch\.cuda")


def test_layers_test_no_types_backends_or_devices():
    assert len(LAYER_FILES) > 15
    hits = [f"{p.name}:{i}: {line.strip()}" for p in LAYER_FILES
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if FORBIDDEN.search(line) and not line.lstrip().startswith("from megamoe.layers.backends")]
    assert hits == []


def test_cuda_and_fp8_refusals_are_one_line():
    """Without CUDA the cuda backend says so; an FP8 recipe on a backend without it names the
    backends that have one."""
    from megamoe.training.config import TrainConfig

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^model.backend='cuda' is unavailable here: no CUDA device"):
            get_backend("cuda")
    with pytest.raises(ConfigError, match=r"^train.fp8='torch' is not available on the cpu backend; "
                                          r"backends with FP8: cuda \(torch\), te \(delayed\|current\|blockwise\|mxfp8\)$"):
        get_backend("cpu", fp8="torch")
    with pytest.raises(ConfigError, match=r"^train.fp8='torch' is not available on the te backend"):
        get_backend("te", fp8="torch")
    with pytest.raises(ConfigError, match=r"^train.fp8"):
        TrainConfig(fp8="e4m3").validate()


def test_te_names_what_is_missing():
    """Without Transformer Engine (never installed in the CPU test environment) or without CUDA,
    model.backend=te is one line naming the missing package or device."""
    from megamoe.layers.backends.te import missing

    why = missing()
    if why is None:
        pytest.skip("transformer_engine imports and CUDA is present here: tests/test_gpu.py runs the te backend")
    assert why.startswith(("transformer_engine is not installed", "no CUDA device"))
    with pytest.raises(ConfigError) as e:
        get_backend("te", fp8="delayed")
    assert str(e.value) == f"model.backend='te' is unavailable here: {why}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("store", [False, True], ids=["resident", "tiered"])
@pytest.mark.parametrize("name", ["cuda", "te"])
def test_the_gpu_backends_build_every_layer_kind_anywhere(registry, name, store):
    """The cuda and te backends' classes build a model of every mixer and MLP kind on any machine
    (their kernels are imported at the first call, not at build): a role override that lost an
    argument of the base role (te's grouped_experts had no ``store=``) fails here, not on a GPU."""
    from megamoe.core.config import ExpertStoreConfig, MoEConfig
    from megamoe.layers.backends.cuda import CudaBackend
    from megamoe.layers.backends.te import TEBackend
    from megamoe.layers.mlp.stored_experts import StoredExperts
    from megamoe.model.language_model import LanguageModel

    registry(f"{name}_probe", {"cuda": CudaBackend, "te": TEBackend}[name])
    expert_store = ExpertStoreConfig(budget_mib=1.0 if store else None)
    cfg = tiny_model("GeKeLdAdMdDdSdId", backend=f"{name}_probe",
                     moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=16, expert_store=expert_store))
    model = LanguageModel(cfg)
    experts = [m.experts for m in model.modules() if hasattr(m, "experts")]
    assert len(experts) == 2 and all(isinstance(e, StoredExperts) == store for e in experts)
