#!/usr/bin/env python
"""Print the plan of a run without starting it: layout, parameter budget, parallel grid and
per-stage memory per rank, or the layouts that fit a device (--gpu-mem), or place experts.
Same as the installed ``megamoe-plan`` (megamoe/commands/plan.py); see --help."""
from megamoe.commands.plan import cli

if __name__ == "__main__":
    cli()
