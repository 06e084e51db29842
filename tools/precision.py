#!/usr/bin/env python
"""Per-layer precision report: each dtype's hidden states against the fp32 run, layer by layer.
Same as ``python -m megamoe.commands.precision`` (megamoe/commands/precision.py); see --help."""
from megamoe.commands.precision import cli

if __name__ == "__main__":
    cli()
