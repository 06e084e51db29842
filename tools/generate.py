#!/usr/bin/env python
"""Generate text with a megamoe model from an HF directory or a megamoe checkpoint.

    python tools/generate.py MODEL_DIR --prompt "Hello" [--tokenizer DIR_OR_FILE] [--max-new-tokens 32]
    python tools/generate.py MODEL_DIR --ids 1,2,3 --sample --temperature 0.8 --top-p 0.9 --seed 0
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
    args = p.parse_args()
    from megamoe.data import load_tokenizer
    from megamoe.errors import ConfigError
    from megamoe.generate import generate

    model = load_model(args.model_dir)
    tok = load_tokenizer(args.tokenizer or args.model_dir) if (args.prompt or args.tokenizer) else None
    if args.ids:
        ids = [int(x) for x in args.ids.split(",")]
    elif args.prompt and tok is not None:
        ids = tok.encode(args.prompt)
    else:
        raise ConfigError("give --prompt (with a tokenizer) or --ids")
    out = generate(model, torch.tensor([ids]), args.max_new_tokens, do_sample=args.sample,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   eos_token_id=tok.eos_id if tok is not None else None, seed=args.seed)
    new = out[0, len(ids):].tolist()
    print(tok.decode(new) if tok is not None else new)


if __name__ == "__main__":
    run_main(main)
