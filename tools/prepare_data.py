#!/usr/bin/env python
"""Tokenise raw text or JSONL into a memory-mapped token directory for pretraining.
Same as the installed ``megamoe-prepare-data`` (megamoe/commands/prepare_data.py); see --help."""
from megamoe.commands.prepare_data import cli

if __name__ == "__main__":
    cli()
