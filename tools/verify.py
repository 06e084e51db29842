#!/usr/bin/env python
"""Compare megamoe against transformers: logits and greedy decoding.
Same as the installed ``megamoe-verify`` (megamoe/commands/verify.py); see --help."""
from megamoe.commands.verify import cli

if __name__ == "__main__":
    cli()
