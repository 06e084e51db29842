"""Per-layer precision report: each dtype's hidden states against the fp32 run, layer by layer.

    python tools/precision.py MODEL --dtypes fp32,bf16 [--reference hf] [--tolerance 1e-2] [--plot err.png]
    megamoe-precision HF_DIR --streamed --backend cpu --dtypes fp32,bf16 [--reference-dtype fp64]
    megamoe-precision HF_DIR --streamed --reference hf --dtypes bf16
    torchrun --nproc-per-node 4 -m megamoe.commands.precision HF_DIR --streamed --tp 2 --ep 2

Prints, per layer (index, mixer letter, MLP letter), the relative error and cosine similarity
of its output against the fp32 run (and, with --reference hf, fp32 megamoe against
transformers), the routing agreement per MoE layer (fraction of tokens with the same top-k
experts) and the first layer past the tolerance; writes a PNG of the error by layer.

--streamed (an HF folder; models that do not fit one host) reads each layer from the checkpoint
only while it runs and compares the kernels a run uses: megamoe on --backend (default: the
config's), in each of --dtypes, with --fp8's GEMMs, against megamoe's pure-torch ``local``
backend in --reference-dtype (fp32 or fp64), or against transformers (--reference hf). Each
layer is compared fed the same input as the reference ("own input": that layer's own error, so
a wrong kernel is named where it is) and fed the reference's own previous output ("chained": the
error as it accumulates). At a layout each pipeline stage's first rank compares its layers.
"""
from __future__ import annotations

import torch

from megamoe.commands.cli import number_in, parallel_flags, parallel_from_args, run_main, streamed_groups, tool_parser
from megamoe.core.dtypes import REFERENCE, SHORT
from megamoe.core.errors import ConfigError


def parser():
    p = tool_parser(__doc__.strip().splitlines()[0])
    p.add_argument("model_dir", help="HF directory or megamoe checkpoint")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, each compared with fp32: fp32, bf16, fp16")
    p.add_argument("--reference", choices=("hf",), help="also compare fp32 megamoe with transformers (HF folders)")
    p.add_argument("--tolerance", type=number_in(float, 0.0), default=5e-2,
                   help="relative error that counts as past tolerance")
    p.add_argument("--batch", type=number_in(int, 1), default=2)
    p.add_argument("--prompt-len", type=number_in(int, 1), default=32)
    p.add_argument("--seed", type=number_in(int, 0), default=0)
    p.add_argument("--plot", help="PNG to write the error by layer to")
    p.add_argument("--streamed", action="store_true",
                   help="compare layer by layer, each layer read from the HF folder only while it runs")
    p.add_argument("--backend", help="--streamed: the backend the compared run uses (default: the config's)")
    p.add_argument("--fp8", help="--streamed: the FP8 recipe of the compared run's GEMMs (as train.fp8)")
    p.add_argument("--reference-dtype", choices=tuple(REFERENCE), default="fp32",
                   help="--streamed: dtype of the local-backend reference")
    parallel_flags(p)
    return p


def dtypes_of(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in SHORT:
            raise ConfigError(f"--dtypes {text}: {name!r} is not one of {', '.join(SHORT)}")
    if not names:
        raise ConfigError("--dtypes: give at least one dtype")
    return names


def hf_comparison(model, hf_dir: str, ids: torch.Tensor, fp32):
    """fp32 megamoe against transformers' hidden states (theirs: after each layer, the last one
    after the final norm, so ours gets the final norm there too)."""
    from pathlib import Path

    from megamoe.diagnostics.verify import load_hf_model
    from megamoe.diagnostics.precision import Capture

    if not (Path(hf_dir) / "config.json").is_file():
        raise ConfigError(f"--reference hf: {hf_dir} is not an HF folder (no config.json)")
    with torch.no_grad():
        theirs = load_hf_model(hf_dir)(input_ids=ids, output_hidden_states=True).hidden_states[1:]
        last = model.final_norm(model.leave_stream(fp32.hidden[-1])).float()
    ours = Capture(fp32.hidden[:-1] + [last], {})
    return ours, Capture([t.float() for t in theirs], {})



def streamed(args, names: list[str]) -> None:
    """The layer-streamed report: each dtype on --backend/--fp8 against the reference."""
    from pathlib import Path

    from megamoe.diagnostics.precision import plot
    from megamoe.diagnostics.validate import streamed_reports

    if not (Path(args.model_dir) / "config.json").is_file():
        raise ConfigError(f"--streamed: {args.model_dir} is not an HF folder (no config.json)")
    what = (args.backend or "megamoe") + (f" fp8={args.fp8}" if args.fp8 else "")
    against = "transformers" if args.reference == "hf" else f"local {args.reference_dtype}"
    candidates = {f"{name} {what} vs {against}": dict(backend=args.backend, dtype=SHORT[name], fp8=args.fp8)
                  for name in names}
    reports = streamed_reports(args.model_dir, candidates, groups=streamed_groups(args),
                               reference=args.reference or "local", reference_dtype=REFERENCE[args.reference_dtype],
                               batch=args.batch, prompt_len=args.prompt_len, seed=args.seed)
    if reports is None:  # not a reporting rank
        return
    for name, report in reports.items():
        print(report.text(name, args.tolerance))
    if args.plot:
        print(f"wrote {plot({n: r.local for n, r in reports.items()}, args.tolerance, args.plot)}")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    names = dtypes_of(args.dtypes)
    if args.streamed:
        return streamed(args, names)
    for flag in ("backend", "fp8"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag}: the kernel comparison reads the model layer by layer: add --streamed")
    if parallel_from_args(args) is not None:
        raise ConfigError("--tp/--pp/--ep: the report at a layout reads the model layer by layer: add --streamed")
    from megamoe.inference.load import load_model
    from megamoe.diagnostics.precision import capture, cast, compare, plot, table

    model = load_model(args.model_dir).float()
    layout = model.config.parsed_layout()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                        generator=torch.Generator().manual_seed(args.seed))
    fp32 = capture(model, ids)
    series = {}
    for name in names:
        rows = compare(fp32, capture(cast(model, SHORT[name]), ids) if name != "fp32" else fp32, layout)
        series[f"{name} vs fp32"] = rows
    if args.reference == "hf":
        ours, theirs = hf_comparison(model, args.model_dir, ids, fp32)
        series["fp32 vs transformers"] = compare(theirs, ours, layout)
    for name, rows in series.items():
        print(table(name, rows, args.tolerance))
    if args.plot:
        print(f"wrote {plot(series, args.tolerance, args.plot)}")


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
