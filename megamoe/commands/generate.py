"""Generate text with a megamoe model from an HF directory or a megamoe checkpoint (a LoRA
fine-tune's checkpoint too: its base comes from its meta.json, the adapters are merged in).

    megamoe-generate MODEL_DIR --prompt "Hello" [--tokenizer DIR_OR_FILE] [--max-new-tokens 32]
    megamoe-generate MODEL_DIR --ids 1,2,3 --sample --temperature 0.8 --top-p 0.9 --seed 0
    megamoe-generate MODEL_DIR --prompt "Hi" --prompt "Once upon a time" --stream   # one batch
    megamoe-generate VLM_DIR --image shapes.png --tokenizer byte     # caption an image
    megamoe-generate CKPT --ids 1,2,3 --expert-budget 4096           # routed experts read from disk as routed
    megamoe-generate CKPT --ids 1,2,3 --expert-budget 4096 --expert-store HF_DIR   # ... from the HF checkpoint
    megamoe-generate HF_DIR --ids 1,2,3 --speculative mtp            # drafts from the model's MTP layers
    torchrun --nproc-per-node 4 -m megamoe.commands.generate HF_DIR --tp 2 --pp 2 --ids 1,2,3   # at a layout
"""
from __future__ import annotations

import torch

from megamoe.commands.cli import BASE_HELP, number_in, parallel_flags, parallel_from_args, run_main, tool_parser
from megamoe.core.errors import ConfigError


def image_prompt(model, path: str, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Placeholders for the image (as many as its preprocessed size gives) before the prompt."""
    from PIL import Image

    if getattr(model, "vision", None) is None:
        raise ConfigError(f"--image {path}: the model has no vision tower")
    prep = model.vision.preprocessor()
    pixels = prep(path)
    with Image.open(path) as img:
        n = model.vision.image_tokens(img)
    return [model.image_token_id] * n + ids, [pixels]


def parse_ids(text: str) -> list[int]:
    """``--ids 1,2,3``: non-negative integers (the vocabulary bound is checked with the model)."""
    ids = []
    for item in text.split(","):
        try:
            ids.append(int(item))
        except ValueError:
            raise ConfigError(f"--ids {text}: {item.strip()!r} is not an integer token id") from None
        if ids[-1] < 0:
            raise ConfigError(f"--ids {text}: {ids[-1]} is negative (token ids are 0 .. vocab_size - 1)")
    return ids


def check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    if not ids:
        raise ConfigError(f"{what}: the prompt is empty (no token ids)")
    too_big = [i for i in ids if i >= vocab_size]
    if too_big:
        raise ConfigError(f"{what}: token id {too_big[0]} is not below the model's vocab_size {vocab_size}")


def parser():
    p = tool_parser(__doc__.strip().splitlines()[0])
    p.add_argument("model_dir", help="HF directory, megamoe checkpoint, LoRA checkpoint or a run's checkpoint folder")
    p.add_argument("--prompt", action="append",
                   help="text to continue (needs --tokenizer or a tokenizer in MODEL_DIR); repeat it for a batch")
    p.add_argument("--ids", action="append", help="comma-separated token ids instead of --prompt; repeatable")
    p.add_argument("--tokenizer", help="'byte', a .model, a tokenizer.json or a tokenizer directory")
    p.add_argument("--max-new-tokens", type=number_in(int, 1), default=32)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=number_in(float, 1e-6), default=1.0)
    p.add_argument("--top-k", type=number_in(int, 0), default=0, help="0: no top-k cut")
    p.add_argument("--top-p", type=number_in(float, 1e-6, 1.0), default=1.0)
    p.add_argument("--seed", type=number_in(int, 0), default=0)
    p.add_argument("--base", help=BASE_HELP)
    p.add_argument("--image", help="an image file for a vision-language model (placed before the prompt)")
    p.add_argument("--prefill-chunk", type=number_in(int, 0), default=0,
                   help="process the prompts in chunks of this many tokens (0: at once)")
    p.add_argument("--stream", action="store_true", help="print '[row] token' lines as tokens are produced")
    p.add_argument("--kv-cache", choices=("contiguous", "paged", "int8", "fp8"), default="contiguous",
                   help="decode cache: contiguous tensors, paged blocks, or paged int8 / fp8 (e4m3) blocks "
                        "with per-block, per-head scales")
    p.add_argument("--block-size", type=number_in(int, 1), default=16, help="tokens per block of a paged cache")
    p.add_argument("--speculative", choices=("mtp",),
                   help="greedy decoding drafted by the model's multi-token-prediction layers (model.mtp): each step "
                        "verifies the drafts in one forward, the tokens are plain greedy's; prints the accepted tokens "
                        "per step (one process, contiguous cache; docs/inference.md)")
    p.add_argument("--compile", action="store_true",
                   help="run each decode step as one torch.compile'd graph (one process, or --tp/--ep/--etp; any "
                        "--kv-cache; the first steps compile, tens of seconds; docs/inference.md)")
    p.add_argument("--expert-budget", type=number_in(float, 1e-6), metavar="MIB",
                   help="tiered experts: keep at most this many MiB of routed experts in memory, reading the "
                        "others from the converted checkpoint when routed to (model.moe.expert_store; one process)")
    p.add_argument("--expert-tier", choices=("disk", "host"), default="disk",
                   help="with --expert-budget: read experts from disk when routed to, or once into host memory")
    p.add_argument("--no-expert-map", dest="expert_map", action="store_false",
                   help="with --expert-budget on a CPU: copy routed experts into cache slots instead of computing "
                        "from the memory-mapped store (model.moe.expert_store.map)")
    p.add_argument("--expert-store", metavar="DIR",
                   help="with --expert-budget: where the experts are read from (a converted checkpoint or the HF "
                        "directory the model was imported from; default: the checkpoint, or its HF directory "
                        "when imported with --experts-in-hf)")
    p.add_argument("--keep-fp8", action="store_true",
                   help="an FP8 HF checkpoint's linear and expert weights stay e4m3 with their block scales, "
                        "dequantised per GEMM (about half the memory of bf16; at any layout: each rank keeps its shards)")
    parallel_flags(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from megamoe.data import load_tokenizer

    prompts = [parse_ids(ids) for ids in args.ids] if args.ids else None  # before the (slow) model load
    if prompts is None and not args.prompt and not args.image:
        raise ConfigError("give --prompt (with a tokenizer), --image (with a tokenizer) or --ids")
    if args.image and len(args.ids or args.prompt or [""]) > 1:
        raise ConfigError("--image: give one prompt with an image")
    check_speculative(args)
    model, forward, show = load_for_layout(args)
    tok = load_tokenizer(args.tokenizer or args.model_dir) if (args.prompt or args.tokenizer) else None
    if prompts is None:
        if tok is None:
            raise ConfigError("--image needs --tokenizer (or --ids) to build the prompt")
        prompts = [tok.encode(text) for text in (args.prompt or [""])]
        for text, ids in zip(args.prompt or [], prompts):
            if not ids:
                raise ConfigError(f"--prompt {text!r}: the tokenizer encodes it to no tokens")
    images = None
    if args.image:
        ids, images = image_prompt(model, args.image, prompts[0])
        prompts = [ids]
    for ids in prompts:
        check_ids(ids, model.config.vocab_size, "--ids" if args.ids else "--prompt")
    longest, limit = max(len(ids) for ids in prompts), model.config.max_seq_len
    drafts = model.config.mtp.num_layers if args.speculative and model.config.mtp is not None else 0
    if longest + args.max_new_tokens + drafts > limit:  # the model's context, not a hang of 10^11 steps
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: with the prompt's {longest} tokens "
                          f"{'and the drafts ' if drafts else ''}that is more than the model's max_seq_len {limit}")
    for line in decode_lines(model, prompts, tok, args, images, forward):
        if show:
            print(line, flush=True)


def check_speculative(args) -> None:
    """--speculative mtp decodes greedily, in one process, with the contiguous cache."""
    if not args.speculative:
        return
    clash = next((flag for flag, on in (("--sample", args.sample), ("--image", args.image), ("--compile", args.compile),
                                        ("--expert-budget", args.expert_budget is not None),
                                        (f"--kv-cache {args.kv_cache}", args.kv_cache != "contiguous"),
                                        ("a parallel layout", parallel_from_args(args) is not None)) if on), None)
    if clash:
        raise ConfigError(f"--speculative mtp: not with {clash} (greedy decoding in one process with the contiguous "
                          f"cache)")


def load_for_layout(args):
    """(model, forward, whether this rank prints): one process, or this rank's stage and shards
    under torchrun at --tp/--pp/--ep/--etp (every rank decodes, the first prints)."""
    import torch.distributed as dist

    from megamoe.inference.distributed import StageForward, inference_groups
    from megamoe.inference.load import load_model

    parallel = parallel_from_args(args)
    store = None
    if args.expert_budget is not None:
        from megamoe.core.config import ExpertStoreConfig

        store = ExpertStoreConfig(budget_mib=args.expert_budget, tier=args.expert_tier, path=args.expert_store,
                                  map=args.expert_map)
    if parallel is None:
        return load_model(args.model_dir, base=args.base, expert_store=store, keep_fp8=args.keep_fp8), None, True
    if store is not None:
        raise ConfigError("--expert-budget runs in one process (drop --tp/--pp/--ep/--etp/--cp)")
    if args.compile and (parallel.pp > 1 or parallel.cp > 1):  # before loading: one graph runs a whole model
        raise ConfigError("--compile with --pp/--cp: compiled decode steps run every layer on each rank "
                          "(--tp/--ep/--etp only)")
    if args.image and parallel.pp > 1:
        raise ConfigError("--image with --pp > 1: the vision tower sits on the first stage only; use --pp 1")
    groups = inference_groups(parallel)
    model = load_model(args.model_dir, groups=groups, keep_fp8=args.keep_fp8)
    # compiled: each rank's graph runs its shards with the collectives inside (one stage, no CP)
    return model, None if args.compile else StageForward(model, groups), dist.get_rank() == 0


def decode_lines(model, prompts: list[list[int]], tok, args, images, forward=None):
    """Decode the prompts as one batch; yield the lines to print (with --stream one per token as
    it comes, then one line per prompt)."""
    from megamoe.inference.distributed import cache_factory
    from megamoe.inference.generate import stream
    from megamoe.inference.speculative import SpeculativeStats, stream_speculative

    new: list[list[int]] = [[] for _ in prompts]
    eos, stats = tok.eos_id if tok is not None else None, SpeculativeStats()
    if args.speculative:
        steps = stream_speculative(model, prompts, args.max_new_tokens, eos_token_id=eos,
                                   prefill_chunk=args.prefill_chunk or None, stats=stats)
    else:
        steps = stream(model, prompts, args.max_new_tokens, do_sample=args.sample, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, eos_token_id=eos, seed=args.seed, images=images,
                       prefill_chunk=args.prefill_chunk or None,
                       cache_factory=cache_factory(args.kv_cache, args.block_size, forward), forward=forward,
                       compile=args.compile)
    for rows, tokens in steps:
        for r, t in zip(rows.tolist(), tokens.tolist()):
            new[r].append(t)
            if args.stream:
                yield f"[{r}] {tok.decode([t]) if tok is not None else t}"
    for ids in new:
        yield tok.decode(ids) if tok is not None else ids
    if args.speculative:
        yield stats.summary()


def cli() -> None:
    run_main(main)


if __name__ == "__main__":
    cli()
