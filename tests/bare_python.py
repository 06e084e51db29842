"""A Python without megamoe: a fresh venv whose dependencies (torch, ...) come from this
environment's site-packages folders, appended after its own. The folders are added as plain
paths, so their .pth files (an editable megamoe's finder among them) are not run: ``import
megamoe`` finds only what the caller installs or puts on the path."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bare_python(where: Path, wheel: Path | None = None) -> Path:
    """The interpreter of a new venv at ``where`` (no pip of its own), with ``wheel`` installed
    (before the dependencies are linked: pip would take an installed megamoe among them for
    this one and skip it)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    if wheel is not None:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                        str(wheel)], check=True, env=clean_env())  # a megamoe on PYTHONPATH would count as installed
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages") and not p.startswith(str(REPO) + "/megamoe")]
    Path(site, "deps.pth").write_text("\n".join(deps) + "\n")
    return py


def clean_env(**extra) -> dict:
    """os.environ without the variables that would put another megamoe or venv on the path."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MEGAMOE_VENV")}
    env.update(extra)
    return env


def plain_copy(dest: Path) -> Path:
    """The checkout's files as a fresh clone (or the GPU machine) has them: tracked and
    untracked-not-ignored, without .git and without what earlier builds left (build/, egg-info)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest
