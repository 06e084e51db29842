"""Shared command-line plumbing for the console entry points (megamoe/commands/) and tools/:
a recipe plus key=value overrides, range-checked numbers, one-line errors.

A user error (a ``MegamoeError``, a file the OS refuses, a bad argument) is one line on stderr
and exit status 2. SIGTERM and SIGINT stop a command cleanly (``megamoe.core.interrupt``): one
line naming what was interrupted and what it left, exit status 128 + the signal. ``--debug`` on any command line, or ``MEGAMOE_DEBUG=1``, lets the exception
through with its traceback instead.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Sequence

from megamoe.core.config import ParallelConfig
from megamoe.core.errors import ConfigError, MegamoeError
from megamoe.core.interrupt import Interrupted, signals_raise

DEBUG_HELP = "show the full traceback of an error (also MEGAMOE_DEBUG=1)"
BASE_HELP = "for a LoRA checkpoint: its base weights, instead of the folder its meta.json records"


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line naming the option (argparse would print the usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def tool_parser(description: str, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser that documents --debug (run_main acts on it)."""
    p = OneLineParser(description=description, **kwargs)
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return p


def recipe_parser(description: str) -> argparse.ArgumentParser:
    p = tool_parser(description)
    p.add_argument("--config", required=True,
                   help="recipe YAML path or shipped recipe name (see megamoe/recipes/)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override recipe values, e.g. model.hidden_size=256 parallel.tp=2")
    return p


def number_in(kind: type, low=None, high=None) -> Callable[[str], int | float]:
    """An argparse ``type=`` that parses ``kind`` and checks ``low <= x <= high`` (either may be None);
    argparse turns the ValueError into one line naming the option."""
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if x != x or (low is not None and x < low) or (high is not None and x > high):  # x != x: NaN
            bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{text} must be {bounds}")
        return x
    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


def debug_wanted(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("MEGAMOE_DEBUG", "") not in ("", "0")


def run_main(main: Callable, argv: Sequence[str] | None = None) -> None:
    """Run ``main(argv)`` (default: the process's arguments); user errors become one line on
    stderr and exit status 2, unless --debug / MEGAMOE_DEBUG=1 asks for the traceback. Other
    exceptions are bugs and keep their traceback."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its import-time notices are not ours
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_wanted(argv)
    try:
        with signals_raise():  # SIGTERM as Ctrl-C: partial outputs are removed on the way out
            main(argv)
    except (MegamoeError, OSError) as e:  # OSError: a path the OS refuses (missing, permission, full disk)
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        if debug:
            raise
        interrupted = isinstance(e, Interrupted)
        print(f"error: {one_line(Exception(e.message())) if interrupted else 'interrupted'}", file=sys.stderr)
        sys.exit(e.exit_status if interrupted else 130)


def one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return " ".join(text.split())


def parallel_flags(parser) -> None:
    """--tp/--pp/--ep/--etp/--cp for a command run under torchrun."""
    group = parser.add_argument_group("parallel layout (run under torchrun; world size = tp*pp*cp*dp, "
                                      "dp ranks decode the same batch; cp splits the prefill and the "
                                      "softmax/MLA/DSA/B decode cache)")
    for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert"), ("etp", "expert tensor"),
                       ("cp", "context (prefill, decode cache)")):
        group.add_argument(f"--{name}", type=number_in(int, 1), default=1, help=f"{what} parallel size")


def parallel_from_args(args) -> ParallelConfig | None:
    """The layout the flags ask for; None for one process without torchrun."""
    import os

    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=args.cp)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and (args.tp, args.pp, args.ep, args.etp, args.cp) == (1,) * 5:
        return None
    return parallel


def streamed_groups(args):
    """The process groups of the layout the flags ask for, for a layer-streamed comparison (None
    in one process); context parallelism is refused (the comparison runs whole sequences)."""
    from megamoe.inference.distributed import inference_groups

    parallel = parallel_from_args(args)
    if parallel is None:
        return None
    if parallel.cp > 1:
        raise ConfigError("--cp: the streamed comparison runs whole sequences; use --tp/--pp/--ep")
    return inference_groups(parallel)
