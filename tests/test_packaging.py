"""The wheel installs megamoe.layers and megamoe.vision; imports respect the layout rules."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.bare_python import bare_python, clean_env, plain_copy
from tests.dist import side_by_side

REPO = Path(__file__).resolve().parent.parent
# The floors (docs/architecture.md draws the same table): a package imports only from its own
# floor or below, lazy imports included, and never round a circle. megamoe/__init__.py, the
# package's front door, may import from any floor.
FLOORS = {
    0: ("core",),
    1: ("parallel",),
    2: ("data", "layers", "vision"),
    3: ("model",),
    4: ("checkpoint",),
    5: ("lora", "convert", "expert_store"),
    6: ("training", "inference", "planning", "diagnostics"),
    7: ("recipe",),
    8: ("commands",),
}
FLOOR = {package: floor for floor, packages in FLOORS.items() for package in packages}


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


def module_name(path: Path) -> str:
    """megamoe.<...> of a file in megamoe/, layers/ or vision/ (the installed names)."""
    rel = path.relative_to(REPO).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts if parts[0] == "megamoe" else ["megamoe", *parts])


def package_files() -> dict[str, Path]:
    return {module_name(p): p for folder in ("megamoe", "layers", "vision") for p in (REPO / folder).rglob("*.py")}


def imports_of(path: Path, module: str, modules) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in ``path``: top-level or inside a function, relative
    ones resolved, ``from megamoe import x`` as module ``megamoe.x`` where that is a module, and
    string constants that name a module (lazy tables for importlib)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[:len(module.split(".")) - node.level + (path.name == "__init__.py")] \
                if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            found += [(node.lineno, s, []) for s in subs] or [(node.lineno, target, names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            found.append((node.lineno, node.value, []))
    return [f for f in found if f[1].startswith("megamoe.")]


def package_of(module: str) -> str:
    return module.split(".")[1]


def package_edges() -> dict[tuple[str, str], list[str]]:
    files = package_files()
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in files.items():
        if module == "megamoe":
            continue
        for line, target, names in imports_of(path, module, files):
            a, b = package_of(module), package_of(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{path.relative_to(REPO)}:{line}")
    return edges


def test_every_package_has_a_floor():
    packages = {package_of(m) for m in package_files() if m != "megamoe"}
    assert packages == set(FLOOR), f"packages without a floor: {packages - set(FLOOR)}; floors without a package: {set(FLOOR) - packages}"


def test_packages_import_only_their_floor_or_below():
    upward = [f"{a} (floor {FLOOR[a]}) imports {b} (floor {FLOOR[b]}): {' '.join(where)}"
              for (a, b), where in sorted(package_edges().items()) if FLOOR[b] > FLOOR[a]]
    assert not upward, "\n".join(upward)


def test_no_import_circles_between_packages():
    graph: dict[str, set[str]] = {}
    for a, b in package_edges():
        graph.setdefault(a, set()).add(b)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for b in graph.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in reach(b)})
    assert not circles, f"package pairs that import each other, directly or round a circle: {circles}"


def test_the_maths_and_data_do_not_import_each_other():
    """Floor 2's packages stand side by side: vision never needs the layers, data neither."""
    side = [(a, b) for a, b in package_edges() if FLOOR[a] == FLOOR[b] == 2]
    assert not side, side


def test_no_private_names_across_packages():
    files = package_files()
    private = [f"{path.relative_to(REPO)}:{line} imports {target}.{n}"
               for module, path in files.items() for line, target, names in imports_of(path, module, files)
               for n in names if n.startswith("_") and package_of(target) != package_of(module) and module != "megamoe"]
    assert not private, private


def test_architecture_page_shows_the_floors():
    """docs/architecture.md's floor table lists the same packages on the same floors."""
    page = (REPO / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| (\d) \| ([^|]+) \|", page, re.M))
    shown = {int(k): tuple(sorted(re.findall(r"`(?:megamoe\.)?(\w+)`", v))) for k, v in rows.items()}
    assert shown == {k: tuple(sorted(v)) for k, v in FLOORS.items()}, shown


def test_the_imports_the_docs_show_work():
    """Every one-line ``from megamoe... import ...`` that README.md and docs/ show imports, without
    a DeprecationWarning (a moved path keeps an alias, but the docs show the new one)."""
    import importlib
    import warnings

    shown = set()
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        shown |= set(re.findall(r"^\s*from (megamoe[\w.]*) import ([\w, ]+)$", page.read_text(), re.M))
    assert shown
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for module, names in sorted(shown):
            mod = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(mod, name) or importlib.import_module(f"{module}.{name}"), f"{module}.{name}"


def test_tools_use_public_package_only():
    for p in (REPO / "tools").rglob("*.py"):
        bad = {m for m in imported_modules(p) if m.split(".")[0] in ("layers", "vision", "tests")}
        assert not bad, f"{p.relative_to(REPO)} imports {sorted(bad)}"


def test_building_and_training_does_not_import_the_compiler():
    """dynamo and inductor (~150 MiB of RSS and 0.3 s per process, every rank) load only when
    something compiles: not from importing the model, trainer, LoRA, tiers or generation."""
    code = ("import sys, megamoe.model.language_model, megamoe.training.trainer, megamoe.lora, megamoe.expert_store, megamoe.inference.generate, "
            "megamoe.layers; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


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
    assert {"torch", "megatron-core", "safetensors", "omegaconf", "tensorboard", "sentencepiece",
            "timm", "tqdm"} <= names
    # einops is not declared: the rearrangements are view/permute/einsum with shape comments, and
    # nothing imports it (a declared dependency nothing uses is one more thing to install and pin)
    assert "einops" not in names
    sources = [p for folder in ("megamoe", "layers", "vision", "tools") for p in (REPO / folder).rglob("*.py")]
    assert not [p for p in sources if re.search(r"^\s*(import|from) einops", p.read_text(), re.M)]
    assert "megatron-core>=0.16.1" in lists["install_requires"]
    assert not any(r.startswith("torch==") for r in lists["install_requires"])  # the GPU machine has another torch
    extras = lists["extras_require"]
    assert {"te", "fla", "hf", "dev", "wandb"} <= set(extras)
    everything = [r for reqs in [lists["install_requires"], *extras.values()] for r in reqs]
    assert not any(re.split(r"[<>=\[ ]", r)[0].lower() == "apex" for r in everything)  # PyPI's apex is another project


COMMANDS = ("pretrain", "finetune", "convert", "generate", "verify", "plan", "captions", "prepare_data",
            "show_model", "precision", "comm_profile")


def test_the_repository_stands_alone():
    """No file points at material outside the repository (benchmark peers, design notes)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    outside = re.compile(r"/work/shared|\.\./shared/|BENCHMARKS\.md")
    offenders = [f for f in tracked if f != "tests/test_packaging.py" and (REPO / f).is_file()
                 and f.endswith((".py", ".md", ".sh", ".yaml", ".sbatch", ".txt", ".cfg", ".toml"))
                 and outside.search((REPO / f).read_text(errors="ignore"))]
    assert not offenders, f"files citing material outside the repository: {offenders}"


def test_every_package_folder_has_an_init():
    """find_packages silently leaves out a folder without __init__.py (megamoe/training once)."""
    missing = [str(d.relative_to(REPO)) for folder in ("megamoe", "layers", "vision")
               for d in [REPO / folder, *(REPO / folder).rglob("*")]
               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert not missing, f"package folders without __init__.py: {missing}"


def test_layers_and_vision_come_from_megamoes_own_copy():
    """Whatever found megamoe here (an editable install's finder, a plain checkout on the path),
    megamoe.layers and megamoe.vision come from the same copy: never another checkout's."""
    import megamoe
    import megamoe.layers
    import megamoe.vision

    root = Path(megamoe.__file__).resolve().parent.parent
    for m in (megamoe.layers, megamoe.vision):
        assert Path(m.__file__).resolve().is_relative_to(root), (m.__file__, root)


def test_wheel_installs_every_module_and_the_commands(tmp_path):
    """The wheel, installed into a fresh venv and run from a folder outside the checkout,
    imports every module it holds and every console entry point answers --help."""
    wheel_dir = tmp_path / "wheel"
    # built from a plain copy: setuptools' build/ in the checkout keeps files an earlier build saw
    # (modules since moved or deleted would ship again), and its egg-info would sit on PYTHONPATH
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(plain_copy(tmp_path / "source"))], check=True, cwd=tmp_path)
    wheel = next(wheel_dir.glob("megamoe-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "megamoe/layers/__init__.py" in names and "megamoe/vision/__init__.py" in names
    assert "megamoe/recipes/tiny_dense.yaml" in names
    top = {n.split("/")[0] for n in names}
    assert not top & {"layers", "vision", "tools", "tests", "pretrain_scripts", "docs"}, top
    # every .py of the package folders is in the wheel (a folder without __init__.py would be missing)
    sources = {f"megamoe/{p.relative_to(REPO / 'megamoe')}" for p in (REPO / "megamoe").rglob("*.py")}
    sources |= {f"megamoe/{p.relative_to(REPO)}" for f in ("layers", "vision") for p in (REPO / f).rglob("*.py")}
    assert not sources - set(names), sorted(sources - set(names))
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py"))
    assert "megamoe.training.trainer" in modules and "megamoe.commands.convert" in modules

    venv = tmp_path / "venv"
    py = bare_python(venv, wheel)  # the installed wheel is what 'import megamoe' finds; the checkout is on no path
    # a `pip --target` install of the same wheel: run from elsewhere its own copy answers; run from
    # the checkout's root (first on sys.path, as on the GPU machine) the checkout's layers/ and
    # vision/ answer with the checkout's megamoe, never a mix of the two copies
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True)
    scripts = [venv / "bin" / f"megamoe-{name.replace('_', '-')}" for name in COMMANDS]
    for script in scripts:
        assert script.is_file(), f"the wheel installs no console script {script.name}"
    code = ("import importlib, sys\n"
            "for m in sys.argv[1:]:\n"
            "    f = importlib.import_module(m).__file__\n"
            "    assert f.startswith(sys.prefix), (m, f)\n"
            "print(len(sys.argv) - 1)")
    where = ("import megamoe, megamoe.layers.backends.cuda as c, megamoe.vision as v, megamoe.model as m\n"
             "print(megamoe.__file__, c.__file__, v.__file__, m.__file__)")
    env, plan = clean_env(), str(venv / "bin" / "megamoe-plan")
    # every run below is independent and mostly imports torch: side by side, each from its folder
    # (cwd), with its environment
    runs = [([str(py), "-c", code, *modules], tmp_path, env),
            *(([str(py), "-c", where], cwd, clean_env(PYTHONPATH=str(target))) for cwd in (tmp_path, REPO)),
            # from any folder: a shipped recipe is found, a run the trainer would refuse is one line
            ([plan, "--config", "tiny_dense"], tmp_path, env),
            ([plan, "--config", "tiny_dense", "parallel.cp=2", "data.seq_len=30"], tmp_path, env),
            *(([str(s), "--help"], tmp_path, env) for s in scripts)]
    outs = side_by_side([cmd for cmd, _, _ in runs], [e for _, _, e in runs], cwds=[cwd for _, cwd, _ in runs])
    imported, *wheres = outs[:3]
    plan, refused = outs[3:5]
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.split()[-1] == str(len(modules))
    for out, (cwd, root) in zip(wheres, ((tmp_path, target), (REPO, REPO))):
        files = out.stdout.split()
        assert out.returncode == 0 and len(files) == 4, (cwd, out.stderr[-2000:])
        assert all(f.startswith(f"{root}/") for f in files), (cwd, files)
    for script, out in zip(scripts, outs[5:]):
        assert out.returncode == 0 and "usage:" in out.stdout and "--debug" in out.stdout, (script.name,
                                                                                           out.stderr[-2000:])
    assert plan.returncode == 0 and "summary:" in plan.stdout, plan.stderr[-2000:]
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: data.seq_len 30 is not divisible by 2*parallel.cp = 4 (context parallelism cuts each sequence "
        "into 2*cp equal chunks)"], refused.stderr
