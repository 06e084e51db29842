"""The wheel installs megamoe.layers and megamoe.vision; imports respect the layout rules."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORE = ["megamoe/config.py", "megamoe/layout.py", "megamoe/spec.py", "megamoe/recipe.py", "megamoe/errors.py",
        "megamoe/cache.py", *[str(p.relative_to(REPO)) for p in (REPO / "megamoe/parallel").glob("*.py")],
        *[str(p.relative_to(REPO)) for p in (REPO / "megamoe/data").glob("*.py")]]


def python_files():
    for folder in ("megamoe", "layers", "vision", "tools", "tests", "pretrain_scripts"):
        yield from (REPO / folder).rglob("*.py")


def test_no_bare_layers_or_vision_imports():
    bare = re.compile(r"^\s*(from|import)\s+(layers|vision)(\.|\s|$)", re.M)
    offenders = [str(p.relative_to(REPO)) for p in python_files() if bare.search(p.read_text())]
    assert not offenders, f"bare 'import layers/vision' (use megamoe.layers/megamoe.vision): {offenders}"


def imported_modules(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
    return mods


def test_core_does_not_import_layers_or_vision():
    for rel in CORE:
        bad = {m for m in imported_modules(REPO / rel) if m.startswith(("megamoe.layers", "megamoe.vision"))}
        assert not bad, f"{rel} (core) imports {sorted(bad)}"


def test_vision_does_not_import_layers():
    for p in (REPO / "vision").rglob("*.py"):
        bad = {m for m in imported_modules(p) if m.startswith("megamoe.layers")}
        assert not bad, f"{p.relative_to(REPO)} imports {sorted(bad)}"


def test_tools_use_public_package_only():
    for p in (REPO / "tools").rglob("*.py"):
        bad = {m for m in imported_modules(p) if m.split(".")[0] in ("layers", "vision", "tests")}
        assert not bad, f"{p.relative_to(REPO)} imports {sorted(bad)}"


def setup_lists() -> dict:
    """install_requires and extras_require as written in setup.py (literals, not executed)."""
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup":
            return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords
                    if kw.arg in ("install_requires", "extras_require")}
    raise AssertionError("setup.py has no setup(...) call")


def test_dependencies_and_extras_never_apex():
    lists = setup_lists()
    names = {re.split(r"[<>=\[ ]", r)[0] for r in lists["install_requires"]}
    assert {"torch", "megatron-core", "einops", "safetensors", "omegaconf", "tensorboard", "sentencepiece",
            "timm", "tqdm"} <= names
    assert "megatron-core>=0.16.1" in lists["install_requires"]
    assert not any(r.startswith("torch==") for r in lists["install_requires"])  # the GPU machine has another torch
    extras = lists["extras_require"]
    assert {"te", "fla", "hf", "dev"} <= set(extras)
    everything = [r for reqs in [lists["install_requires"], *extras.values()] for r in reqs]
    assert not any(re.split(r"[<>=\[ ]", r)[0].lower() == "apex" for r in everything)  # PyPI's apex is another project


def test_wheel_installs_mapped_subpackages(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(REPO)], check=True, cwd=tmp_path)
    wheel = next(wheel_dir.glob("megamoe-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "megamoe/layers/__init__.py" in names and "megamoe/vision/__init__.py" in names
    assert "megamoe/recipes/tiny_dense.yaml" in names
    top = {n.split("/")[0] for n in names}
    assert not top & {"layers", "vision", "tools", "tests", "pretrain_scripts", "docs"}, top

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # dependencies (torch, ...) come from this environment's site-packages, appended after the
    # new venv's own, so the installed wheel is what 'import megamoe' finds
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = ("import megamoe, megamoe.layers, megamoe.vision, megamoe.model; "
            "print(megamoe.__file__); print(megamoe.layers.__file__)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True,
                         cwd=tmp_path, env=env).stdout.split()
    assert all(str(venv) in line for line in out), out
