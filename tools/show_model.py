#!/usr/bin/env python
"""Print a recipe's layout, per-layer kinds and parameter budget without allocating weights.
Same as the installed ``megamoe-show-model`` (megamoe/commands/show_model.py); see --help."""
from megamoe.commands.show_model import cli

if __name__ == "__main__":
    cli()
