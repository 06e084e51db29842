#!/usr/bin/env python
"""The Python steps of tools/gpu_check.sh (run from the checkout's root).

    python3 tools/gpu_check.py env [--rehearse]          # versions, the GPU, every module imported
    python3 tools/gpu_check.py summary LOGDIR [--rehearse]  # the one summary line of the check

``env`` imports every module of this checkout (megamoe/, and layers/ and vision/ as
megamoe.layers and megamoe.vision) and checks that each comes from this checkout, not from an
installed copy. On the device CUDA, fla and megatron-core are required; in a rehearsal (any
machine) fla must be absent: importable, it breaks transformers' CPU reference models.
Exit status 1, one line per problem, when anything is missing or out of place.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (import name, needed on the device, needed in a rehearsal)
PACKAGES = [("torch", True, True), ("megatron.core", True, True), ("fla", True, False),
            ("transformers", True, True), ("timm", True, True), ("omegaconf", True, True),
            ("safetensors", True, True), ("pytest", True, True), ("pytest_timeout", True, True),
            ("transformer_engine", False, False)]
METRICS = ("mfu_bf16", "gpu_speedup_vs_hf", "grouped_vs_dense", "fp8_speedup")


def checkout_modules() -> list[str]:
    """Every module of the checkout, by the name it is imported as."""
    names = []
    for folder, package in (("megamoe", "megamoe"), ("layers", "megamoe.layers"), ("vision", "megamoe.vision")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            names.append(".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts)))
    return names


def check_packages(rehearse: bool) -> list[str]:
    problems = []
    for name, device, rehearsal in PACKAGES:
        try:
            mod = importlib.import_module(name)
            print(f"{name} {getattr(mod, '__version__', 'ok')}")
            if name == "fla" and rehearse:
                problems.append("fla is importable here: the main test environment must not have it "
                                "(tools/fla_interpret.sh brings its own)")
        except Exception as e:  # noqa: BLE001 - reported, then judged below
            print(f"{name} MISSING: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if (rehearsal if rehearse else device):
                problems.append(f"{name} does not import")
    return problems


def check_device() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return ["no CUDA device (torch.cuda.is_available() is False)"]
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2 ** 30:.0f} GiB, capability {p.major}.{p.minor}, "
          f"torch {torch.__version__} cuda {torch.version.cuda}")
    return []


def check_autotune_limit() -> list[str]:
    """tools/triton_site was loaded: Triton's autotuner takes MEGAMOE_AUTOTUNE_CONFIGS configs."""
    import os

    limit = os.environ.get("MEGAMOE_AUTOTUNE_CONFIGS")
    if not limit or importlib.util.find_spec("triton") is None:
        return []
    from triton.runtime.autotuner import Autotuner

    if Autotuner.prune_configs.__name__ != "first_configs":
        return [f"MEGAMOE_AUTOTUNE_CONFIGS={limit} but Triton's autotuner is unchanged (tools/triton_site "
                f"is not first on PYTHONPATH, or another sitecustomize was loaded)"]
    print(f"triton autotune: the first {limit} config(s) of each kernel")
    return []


def check_imports() -> list[str]:
    problems = []
    names = checkout_modules()
    for name in names:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name} does not import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        where = Path(getattr(mod, "__file__", "") or "").resolve()
        if ROOT not in where.parents:
            problems.append(f"{name} comes from {where}, not from this checkout ({ROOT})")
    print(f"imported {len(names) - len(problems)} of {len(names)} modules from {ROOT}")
    return problems


def env(rehearse: bool) -> int:
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    problems = check_packages(rehearse)
    if not rehearse:
        problems += check_device()
    problems += check_autotune_limit() + check_imports()
    for line in problems:
        print(f"problem: {line}")
    return 1 if problems else 0


def test_counts(log: Path) -> dict:
    """passed/failed/skipped from pytest's JUnit XML (errors count as failed)."""
    xml = log / "tests.xml"
    if not xml.is_file():
        return {"passed": 0, "failed": 0, "skipped": 0}
    suites = ET.parse(xml).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def bench_metrics(log: Path) -> dict:
    text = (log / "bench.log").read_text(errors="replace") if (log / "bench.log").is_file() else ""
    found = dict(re.findall(r"\b(" + "|".join(METRICS) + r")=([-+0-9.eE]+|nan|inf)", text))
    return {m: found.get(m, "n/a") for m in METRICS}


def summary(log: Path, rehearse: bool, failed_phases: list[str]) -> int:
    if rehearse:
        collected = re.findall(r"(\d+)(?:/\d+)? tests? collected", _read(log / "tests.log"))
        imported = re.findall(r"imported (\d+) of (\d+) modules", _read(log / "env.log"))
        mods = f"{imported[-1][0]}/{imported[-1][1]}" if imported else "n/a"
        print(f"gpu_check --rehearse: {collected[-1] if collected else 'n/a'} gpu tests collected, "
              f"{mods} modules imported; failed phases: {', '.join(failed_phases) or 'none'}")
        return 1 if failed_phases else 0
    counts, metrics = test_counts(log), bench_metrics(log)
    print(f"gpu_check: {counts['passed']} passed {counts['failed']} failed {counts['skipped']} skipped; "
          + " ".join(f"{k}={v}" for k, v in metrics.items())
          + (f"; failed phases: {', '.join(failed_phases)}" if failed_phases else ""))
    (log / "summary.json").write_text(json.dumps({**counts, **metrics, "failed_phases": failed_phases}) + "\n")
    return 1 if failed_phases or counts["failed"] else 0


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    e = sub.add_parser("env", help="versions, the GPU, every module of the checkout imported")
    e.add_argument("--rehearse", action="store_true", help="any machine: no GPU, and fla must be absent")
    s = sub.add_parser("summary", help="the check's one summary line from its logs")
    s.add_argument("log", type=Path)
    s.add_argument("--rehearse", action="store_true")
    s.add_argument("--failed-phases", default="", help="comma-separated phases that did not pass")
    args = p.parse_args()
    if args.step == "env":
        sys.exit(env(args.rehearse))
    sys.exit(summary(args.log, args.rehearse, [f for f in args.failed_phases.split(",") if f]))


if __name__ == "__main__":
    main()
