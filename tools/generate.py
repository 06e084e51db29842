#!/usr/bin/env python
"""Generate text with a megamoe model from an HF directory or a megamoe checkpoint.

    python tools/generate.py MODEL_DIR --prompt "Hello" [--tokenizer DIR_OR_FILE] [--max-new-tokens 32]
    python tools/generate.py MODEL_DIR --ids 1,2,3 --sample --temperature 0.8 --top-p 0.9 --seed 0
    python tools/generate.py VLM_DIR --image shapes.png --tokenizer byte     # caption an image
"""
import argparse
from pathlib import Path

import torch

from megamoe.cli import run_main


def load_model(path: str):
    """An HF directory (config.json) or a megamoe checkpoint (meta.json)."""
    from megamoe.convert import build_model, from_hf
    from megamoe.recipe import config_from_dict
    from megamoe.training.checkpoint import load_checkpoint, read_meta

    if (Path(path) / "config.json").is_file():
        return from_hf(path)
    meta = read_meta(path)
    model = build_model(config_from_dict(meta["model"]))
    load_checkpoint(path, model.groups, [model], load_rng=False)
    return model.eval()


def image_prompt(model, path: str, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Placeholders for the image (as many as its preprocessed size gives) before the prompt."""
    from PIL import Image

    from megamoe.errors import ConfigError

    if getattr(model, "vision", None) is None:
        raise ConfigError(f"--image {path}: the model has no vision tower")
    prep = model.vision.preprocessor()
    pixels = prep(path)
    with Image.open(path) as img:
        n = model.vision.image_tokens(img)
    return [model.image_token_id] * n + ids, [pixels]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--prompt", help="text to continue (needs --tokenizer or a tokenizer in MODEL_DIR)")
    p.add_argument("--ids", help="comma-separated token ids instead of --prompt")
    p.add_argument("--tokenizer", help="'byte', a .model, a tokenizer.json or a tokenizer directory")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image", help="an image file for a vision-language model (placed before the prompt)")
    args = p.parse_args()
    from megamoe.data import load_tokenizer
    from megamoe.errors import ConfigError
    from megamoe.generate import generate

    model = load_model(args.model_dir)
    tok = load_tokenizer(args.tokenizer or args.model_dir) if (args.prompt or args.tokenizer) else None
    if args.ids:
        ids = [int(x) for x in args.ids.split(",")]
    elif tok is not None and (args.prompt or args.image):
        ids = tok.encode(args.prompt or "")
    else:
        raise ConfigError("give --prompt (with a tokenizer), --image (with a tokenizer) or --ids")
    images = None
    if args.image:
        ids, images = image_prompt(model, args.image, ids)
    out = generate(model, torch.tensor([ids]), args.max_new_tokens, do_sample=args.sample,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   eos_token_id=tok.eos_id if tok is not None else None, seed=args.seed, images=images)
    new = out[0, len(ids):].tolist()
    print(tok.decode(new) if tok is not None else new)


if __name__ == "__main__":
    run_main(main)
