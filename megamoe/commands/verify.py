"""Compare megamoe against transformers: logits and greedy decoding.

    megamoe-verify HF_DIR [--atol 1e-4] [--tokens 16] [--prompt-len 12]
    megamoe-verify CKPT_DIR        # a megamoe or LoRA checkpoint: exported to HF (adapters merged), then compared
    torchrun --nproc-per-node 2 -m megamoe.commands.verify HF_DIR --tp 2   # megamoe at a layout, read sharded
    megamoe-verify HF_DIR --streamed [--tolerance 1e-4] [--plot err.png]  # layer by layer, one layer in memory
    torchrun --nproc-per-node 4 -m megamoe.commands.verify HF_DIR --streamed --tp 2 --ep 2

--streamed reads each layer (megamoe's shard of it, then transformers' whole layer) from the
checkpoint only while it runs, so neither model is ever whole in memory: per layer it prints the
relative error, cosine and routing agreement of megamoe's output against transformers' layer fed
the same input ("own input") and fed transformers' own previous output ("chained"), and the first
layer past --tolerance. At a layout each pipeline stage's first rank compares its layers.

Exits 1 when the logits differ by more than --atol or decoding differs (--streamed: or a layer's
error on its own input passes --tolerance).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from megamoe.commands.cli import (BASE_HELP, number_in, parallel_flags, parallel_from_args, run_main, streamed_groups,
                                  tool_parser)


def main(argv: list[str] | None = None) -> None:
    p = tool_parser(__doc__.strip().splitlines()[0])
    p.add_argument("model_dir", metavar="HF_OR_CKPT_DIR")
    p.add_argument("--atol", type=number_in(float, 0.0), default=1e-4, help="max abs logit difference allowed (fp32)")
    p.add_argument("--tokens", type=number_in(int, 1), default=16, help="greedy tokens to compare")
    p.add_argument("--prompt-len", type=number_in(int, 1), default=12)
    p.add_argument("--seed", type=number_in(int, 0), default=0)
    p.add_argument("--base", help=BASE_HELP)
    p.add_argument("--streamed", action="store_true",
                   help="compare layer by layer, each layer read from the HF folder only while it runs")
    p.add_argument("--tolerance", type=number_in(float, 0.0), default=1e-4,
                   help="--streamed: relative error of a layer's output that counts as past tolerance")
    p.add_argument("--plot", help="--streamed: PNG to write the error by layer to")
    parallel_flags(p)
    args = p.parse_args(argv)
    if args.streamed:
        sys.exit(verify_streamed(args))
    from megamoe.diagnostics.verify import verify

    def run(hf_dir, model=None, **layout):
        return verify(hf_dir, prompt_len=args.prompt_len, new_tokens=args.tokens, seed=args.seed, atol=args.atol,
                      model=model, **layout)

    parallel = parallel_from_args(args)
    if parallel is not None:
        report = verify_at_layout(args.model_dir, parallel, run)
        if report is None:  # not the reporting rank
            return
    elif (Path(args.model_dir) / "config.json").is_file():
        report = run(args.model_dir)
    else:
        report = verify_checkpoint(args.model_dir, run, args.base)
    print(report)
    print("OK" if report.ok else "MISMATCH")
    sys.exit(0 if report.ok else 1)


def verify_streamed(args) -> int:
    """The layer-streamed comparison against transformers; the exit status."""
    from megamoe.core.errors import ConfigError
    from megamoe.diagnostics.precision import plot
    from megamoe.diagnostics.validate import streamed_reports, verdict

    if not (Path(args.model_dir) / "config.json").is_file():
        raise ConfigError(f"--streamed: {args.model_dir} is not an HF folder (no config.json)")
    groups = streamed_groups(args)
    reports = streamed_reports(args.model_dir, {"megamoe": {}}, groups=groups, prompt_len=args.prompt_len,
                               seed=args.seed)
    if reports is None:  # not a reporting rank
        return 0
    report = reports["megamoe"]
    print(report.text("megamoe vs transformers", args.tolerance))
    if args.plot:
        print(f"wrote {plot({'own input': report.local, 'chained': report.chain}, args.tolerance, args.plot)}")
    ok = verdict(report, args.tolerance, args.atol)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def verify_at_layout(hf_dir: str, parallel, run):
    """Every rank builds its stage from the HF folder, sharded on load; rank 0 alone loads the
    transformers reference and gets the report."""
    import torch.distributed as dist

    from megamoe.core.errors import ConfigError
    from megamoe.inference.distributed import StageForward, inference_groups
    from megamoe.inference.load import load_model

    if not (Path(hf_dir) / "config.json").is_file():
        raise ConfigError(f"{hf_dir}: at a parallel layout verify reads an HF folder (export a checkpoint first)")
    groups = inference_groups(parallel)
    model = load_model(hf_dir, groups=groups)
    return run(hf_dir, model, forward=StageForward(model, groups), reference=dist.get_rank() == 0)


def verify_checkpoint(path: str, run, base: str | None = None):
    """A megamoe checkpoint: its model (LoRA adapters merged) against transformers on the same
    weights written as an HF directory (in a temporary folder, removed afterwards)."""
    from megamoe.checkpoint.open import open_checkpoint
    from megamoe.inference.load import load_model
    from megamoe.convert import to_hf
    from megamoe.core.errors import CheckpointError

    if not open_checkpoint(path).hf_origin(base):
        raise CheckpointError(f"{path}: the weights did not come from an HF checkpoint, so there is no "
                              f"transformers family to compare with")
    model = load_model(path, base=base)
    with tempfile.TemporaryDirectory(prefix="megamoe-verify-") as tmp:
        hf_dir = to_hf(model, Path(tmp) / "hf")
        return run(hf_dir, model)


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
