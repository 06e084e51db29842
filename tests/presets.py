"""A preset's budget measured as a user meets it, in a fresh process (so the peak RSS is the build's
own): ``meta_budget`` builds the recipe on meta (``megamoe.planning.plan.budget``),
``show_model_counts`` runs ``megamoe-show-model --config NAME`` and reads its printed totals."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def meta_budget(recipe: str) -> dict:
    """{total, active, seconds (CPU time of the build: the shared test machine's load must not
    decide the test), rss_mib (the process's peak)} of the shipped recipe ``recipe``."""
    code = textwrap.dedent(f"""
        import json, time
        from megamoe.diagnostics.memory import peak_rss_mib
        from megamoe.planning.plan import budget
        from megamoe.recipe import load_recipe
        cfg = load_recipe({recipe!r}).model
        t = time.process_time()
        b = budget(cfg)
        print(json.dumps({{"total": b.total, "active": b.active, "seconds": time.process_time() - t,
                          "rss_mib": peak_rss_mib()}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def show_model_counts(name: str) -> dict:
    """``megamoe-show-model --config name`` in a fresh process: its printed totals, peak RSS and
    seconds of CPU time (on a machine shared by many jobs the wall time measures the others)."""
    code = textwrap.dedent(f"""
        import contextlib, io, json, resource
        def cpu():
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime
        t = cpu()
        from megamoe.commands.show_model import main
        from megamoe.diagnostics.memory import peak_rss_mib
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["--config", "{name}"])
        print(json.dumps({{"out": out.getvalue(), "seconds": cpu() - t, "rss_mib": peak_rss_mib()}}))
    """)
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    line = next(x for x in result["out"].splitlines() if x.startswith("total parameters:"))
    total, active = (int(v.replace(",", "")) for v in line.replace("active per token:", ":").split(":")[1:])
    return dict(result, total=total, active=active)
