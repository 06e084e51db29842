"""A preset's budget measured as a user meets it: a fresh process (so the peak RSS is the build's own)
builds the recipe on meta (``megamoe.planning.plan.budget``)."""
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
