#!/usr/bin/env python
"""Held-out caption accuracy of an exported vision-language model (greedy decoding by transformers).

    python tools/caption_eval.py OUT/hf --log-dir OUT/tb [--images 64] [--seed 2026]

Reads the training recipe from LOG_DIR/recipe.yaml (written by tools/pretrain.py), draws
--images new pairs from its data.generator with --seed (never data.seed), captions them,
prints the exact-match and per-field accuracy with two examples, and appends the accuracy
to LOG_DIR's metrics.jsonl and TensorBoard (eval/caption_*) at the recipe's last step.
"""
import argparse
import time
from pathlib import Path

from megamoe.cli import run_main


def quiet_load(hf_dir: str):
    """The transformers model, without its notices about missing CUDA kernels and progress bars."""
    import transformers

    from megamoe.convert.verify import load_hf_model

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return load_hf_model(hf_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("hf_dir")
    p.add_argument("--log-dir", required=True, help="the training run's log dir (recipe.yaml, metrics.jsonl)")
    p.add_argument("--images", type=int, default=64, help="held-out images to caption")
    p.add_argument("--seed", type=int, default=2026, help="seed of the held-out pairs (not the recipe's data.seed)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=80)
    args = p.parse_args()
    import transformers

    from megamoe.caption_eval import caption_images, held_out_pairs, record, score_captions
    from megamoe.data import build_tokenizer
    from megamoe.errors import ConfigError
    from megamoe.training.entry import load_train_recipe

    if args.images <= 0:
        raise ConfigError(f"--images must be > 0, got {args.images}")
    recipe_file = Path(args.log_dir) / "recipe.yaml"
    if not recipe_file.is_file():
        raise ConfigError(f"--log-dir {args.log_dir}: no recipe.yaml (the log dir of a tools/pretrain.py run)")
    recipe = load_train_recipe(str(recipe_file), validate=False)
    start = time.perf_counter()
    images, truths = zip(*held_out_pairs(recipe, args.images, args.seed))
    hf_model = quiet_load(args.hf_dir)
    print(f"transformers {transformers.__version__} loads {args.hf_dir} as {type(hf_model).__name__} "
          f"({sum(p.numel() for p in hf_model.parameters()):,} parameters)")
    generated = caption_images(args.hf_dir, list(images), build_tokenizer(recipe.data), args.max_new_tokens,
                               args.batch_size, hf_model=hf_model)
    score = score_captions(generated, list(truths), args.seed)
    record(args.log_dir, recipe.train.steps, score)
    print(score.report())
    print(f"  ({len(images)} images captioned in {time.perf_counter() - start:.1f} s; recorded in "
          f"{Path(args.log_dir) / 'metrics.jsonl'} and TensorBoard eval/caption_*)")


if __name__ == "__main__":
    run_main(main)
