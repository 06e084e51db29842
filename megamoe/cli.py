"""Shared command-line plumbing for tools/: a recipe plus key=value overrides, one-line errors."""
from __future__ import annotations

import argparse
import logging
import sys

from megamoe.errors import MegamoeError


def recipe_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True,
                   help="recipe YAML path or shipped recipe name (see megamoe/recipes/)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override recipe values, e.g. model.hidden_size=256 parallel.tp=2")
    return p


def run_main(main) -> None:
    """Run ``main()``; megamoe errors become one line on stderr and exit status 2."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its import-time notices are not ours
    try:
        main()
    except MegamoeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
