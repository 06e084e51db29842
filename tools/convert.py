#!/usr/bin/env python
"""Convert checkpoints between HF and megamoe, streaming one tensor at a time.
Same as the installed ``megamoe-convert`` (megamoe/commands/convert.py); see --help."""
from megamoe.commands.convert import cli

if __name__ == "__main__":
    cli()
