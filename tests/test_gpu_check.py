"""tools/gpu_check.sh rehearsed on CPU (the device run is one call on a lent GPU, docs/gpu.md):
a plain copy of the checkout (what the device receives), run from its root by a Python that has
no megamoe installed, imports every module from that copy and collects the `gpu` tests without
error; the phase limits fit the budget; a failing step is a non-zero exit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.bare_python import REPO, bare_python, clean_env, plain_copy


def test_a_plain_checkout_rehearses_the_gpu_check(tmp_path):
    copy = plain_copy(tmp_path / "checkout")
    py = bare_python(tmp_path / "venv")
    run = subprocess.run(["bash", "tools/gpu_check.sh", "--rehearse"], cwd=copy, capture_output=True, text=True,
                         env=clean_env(PYTHON=str(py), OUT=str(tmp_path / "log")), timeout=900)
    last = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert last.startswith("gpu_check --rehearse: ") and last.endswith("failed phases: none"), last
    collected, imported = int(last.split()[2]), last.split()[6].split("/")
    assert collected >= 20 and imported[0] == imported[1], last
    assert f"from {copy}" in (tmp_path / "log" / "env.log").read_text()


def test_phase_limits_over_the_budget_or_a_failing_step_exit_non_zero(tmp_path):
    over = subprocess.run(["bash", "tools/gpu_check.sh", "--rehearse"], cwd=REPO, capture_output=True, text=True,
                          env=clean_env(GPU_CHECK_BUDGET_S="300", OUT=str(tmp_path / "a")), timeout=60)
    assert over.returncode == 1 and "over the 300s budget" in over.stdout, over.stdout
    wrong = subprocess.run(["bash", "tools/gpu_check.sh", "--fast"], cwd=REPO, capture_output=True, text=True)
    assert wrong.returncode == 2 and wrong.stderr.startswith("usage:")


def test_the_summary_counts_tests_and_reads_the_bench_line(tmp_path):
    (tmp_path / "tests.xml").write_text('<testsuites><testsuite tests="9" failures="1" errors="1" skipped="2">'
                                        '</testsuite></testsuites>')
    (tmp_path / "bench.log").write_text("transformers: 90 ms/step\nmfu_bf16=0.214 gpu_speedup_vs_hf=1.62 "
                                        "grouped_vs_dense=0.71 fp8_speedup=1.18\n")
    run = subprocess.run([sys.executable, "tools/gpu_check.py", "summary", str(tmp_path), "--failed-phases", ""],
                         cwd=REPO, capture_output=True, text=True)
    assert run.stdout.strip() == ("gpu_check: 5 passed 2 failed 2 skipped; mfu_bf16=0.214 gpu_speedup_vs_hf=1.62 "
                                  "grouped_vs_dense=0.71 fp8_speedup=1.18")
    assert run.returncode == 1  # a failed test fails the check
