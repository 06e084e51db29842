#!/usr/bin/env python
"""Held-out caption accuracy of an exported vision-language model (greedy decoding by transformers).
Same as the installed ``megamoe-captions`` (megamoe/commands/captions.py); see --help."""
from megamoe.commands.captions import cli

if __name__ == "__main__":
    cli()
