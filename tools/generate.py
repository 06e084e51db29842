#!/usr/bin/env python
"""Generate text with a megamoe model from an HF directory or a megamoe checkpoint (a LoRA
Same as the installed ``megamoe-generate`` (megamoe/commands/generate.py); see --help."""
from megamoe.commands.generate import cli

if __name__ == "__main__":
    cli()
