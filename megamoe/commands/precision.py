"""Per-layer precision report: each dtype's hidden states against the fp32 run, layer by layer.

    python tools/precision.py MODEL --dtypes fp32,bf16 [--reference hf] [--tolerance 1e-2] [--plot err.png]

Prints, per layer (index, mixer letter, MLP letter), the relative error and cosine similarity
of its output against the fp32 run (and, with --reference hf, fp32 megamoe against
transformers), the routing agreement per MoE layer (fraction of tokens with the same top-k
experts) and the first layer past the tolerance; writes a PNG of the error by layer.
"""
from __future__ import annotations

import torch

from megamoe.commands.cli import number_in, run_main, tool_parser
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
    return p


def dtypes_of(text: str) -> list[str]:
    from megamoe.diagnostics.precision import DTYPES

    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in DTYPES:
            raise ConfigError(f"--dtypes {text}: {name!r} is not one of {', '.join(DTYPES)}")
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


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    names = dtypes_of(args.dtypes)
    from megamoe.inference.load import load_model
    from megamoe.diagnostics.precision import DTYPES, capture, cast, compare, plot, table

    model = load_model(args.model_dir).float()
    layout = model.config.parsed_layout()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                        generator=torch.Generator().manual_seed(args.seed))
    fp32 = capture(model, ids)
    series = {}
    for name in names:
        rows = compare(fp32, capture(cast(model, DTYPES[name]), ids) if name != "fp32" else fp32, layout)
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
