#!/usr/bin/env python
"""Communication profile of a parallel layout (p50/p90/p99 latency, bandwidth per group and size).
Same as ``python -m megamoe.commands.comm_profile`` (megamoe/commands/comm_profile.py); see --help."""
from megamoe.commands.comm_profile import cli

if __name__ == "__main__":
    cli()
