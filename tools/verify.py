#!/usr/bin/env python
"""Compare megamoe against transformers on an HF checkpoint: logits and greedy decoding.

    python tools/verify.py HF_DIR [--atol 1e-4] [--tokens 16] [--prompt-len 12]

Exits 1 when the logits differ by more than --atol or decoding differs.
"""
import argparse
import sys

from megamoe.cli import run_main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("hf_dir")
    p.add_argument("--atol", type=float, default=1e-4, help="max abs logit difference allowed (fp32)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens to compare")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from megamoe.convert.verify import verify

    report = verify(args.hf_dir, prompt_len=args.prompt_len, new_tokens=args.tokens, seed=args.seed, atol=args.atol)
    print(report)
    print("OK" if report.ok else "MISMATCH")
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    run_main(main)
