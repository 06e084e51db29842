"""Held-out caption accuracy of an exported vision-language model (greedy decoding by transformers).

    megamoe-captions OUT/hf --log-dir OUT/tb [--images 64] [--seed 2026]

Reads the training recipe from LOG_DIR/recipe.yaml (written by megamoe-pretrain), draws
--images new pairs from its data.generator with --seed (never data.seed), captions them with
the transformers model of the HF directory, prints the exact-match and per-field accuracy with
a right and a wrong example, and appends the accuracy to LOG_DIR's metrics.jsonl and
TensorBoard (eval/caption_*) at the recipe's last step (megamoe/diagnostics/caption_eval.py).
"""
from __future__ import annotations

import time
from pathlib import Path

from megamoe.commands.cli import number_in, run_main, tool_parser


def quiet_load(hf_dir: str):
    """The transformers model, without its notices about missing CUDA kernels or progress bars."""
    import transformers

    from megamoe.diagnostics.verify import load_hf_model

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return load_hf_model(hf_dir)


def main(argv: list[str] | None = None) -> None:
    p = tool_parser(__doc__.strip().splitlines()[0])
    p.add_argument("hf_dir")
    p.add_argument("--log-dir", required=True, help="the training run's log dir (recipe.yaml, metrics.jsonl)")
    p.add_argument("--images", type=number_in(int, 1), default=64, help="held-out images to caption")
    p.add_argument("--seed", type=number_in(int, 0), default=2026,
                   help="seed of the held-out pairs (not the recipe's data.seed)")
    p.add_argument("--batch-size", type=number_in(int, 1), default=64)
    p.add_argument("--max-new-tokens", type=number_in(int, 1), default=80)
    args = p.parse_args(argv)
    import transformers

    from megamoe.diagnostics.caption_eval import caption_images, held_out_pairs, record, score_captions
    from megamoe.data import build_tokenizer
    from megamoe.core.errors import ConfigError
    from megamoe.recipe import load_train_recipe

    recipe_file = Path(args.log_dir) / "recipe.yaml"
    if not recipe_file.is_file():
        raise ConfigError(f"--log-dir {args.log_dir}: no recipe.yaml (the log dir of a megamoe-pretrain run)")
    recipe = load_train_recipe(str(recipe_file), validate=False)
    start = time.perf_counter()
    images, truths = zip(*held_out_pairs(recipe, args.images, args.seed))
    hf_model = quiet_load(args.hf_dir)
    print(f"transformers {transformers.__version__} loads {args.hf_dir} as {type(hf_model).__name__} "
          f"({sum(p.numel() for p in hf_model.parameters()):,} parameters)")
    generated, corrected = caption_images(args.hf_dir, list(images), build_tokenizer(recipe.data),
                                          args.max_new_tokens, args.batch_size, hf_model=hf_model)
    score = score_captions(generated, list(truths), args.seed)
    record(args.log_dir, recipe.train.steps, score)
    print(score.report())
    print(f"  ({len(images)} images captioned in {time.perf_counter() - start:.1f} s by greedy decoding: "
          f"megamoe's draft of the same checkpoint, every token checked by a transformers forward, "
          f"{corrected} caption(s) corrected; recorded in {Path(args.log_dir) / 'metrics.jsonl'} and "
          f"TensorBoard eval/caption_*)")


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
