#!/usr/bin/env python
"""Pretrain a model from a recipe (YAML + key=value overrides), on one or many processes.
Same as the installed ``megamoe-pretrain`` (megamoe/commands/pretrain.py); see --help."""
from megamoe.commands.pretrain import cli

if __name__ == "__main__":
    cli()
