#!/usr/bin/env python
"""Fine-tune a model from existing weights (a converted HF checkpoint or a training checkpoint).
Same as the installed ``megamoe-finetune`` (megamoe/commands/finetune.py); see --help."""
from megamoe.commands.finetune import cli

if __name__ == "__main__":
    cli()
