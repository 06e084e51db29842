"""Greedy and sampled decoding with the mixers' shared decode cache.

Prompts of different lengths decode as one batch: they are left-padded to the longest (see
``megamoe.layers.cache.decode``), the prompt is processed in chunks of ``prefill_chunk`` time steps
(chunked prefill: a long prompt never runs as one huge forward), then every step feeds one
token per row. A row that produced EOS leaves the batch (its cache rows are dropped, its
blocks freed in a paged cache). ``stream`` yields each step's tokens as they come; ``generate``
and ``generate_batch`` collect them. Under tensor parallelism every rank gets the full logits
and, with the same seed, picks the same token.

``compile=True`` (one process, or each rank of a TP/EP layout) runs every one-token decode step as one ``torch.compile``d
graph of the whole model (``compiled_step``; the prefill stays eager): inductor fuses the
step's small elementwise ops and drops most per-op dispatch, which is most of a small model's
decode step on CPU. The first two steps compile (tens of seconds on 2 cores; two graphs: the
cache length and time step specialised, then symbolic); later generations with the same
model reuse them (past dynamo's ``recompile_limit`` of models in one process, steps run
eagerly, with torch's warning). The routed experts run as one opaque op in the graph
(``megamoe.layers.mlp.experts.local_experts``). A paged cache is reserved for the whole generation
first (``PagedCache.reserve``: its blocks assigned up front, so a step reads and writes them by
tensor arithmetic inside the graph). Greedy tokens match the eager steps'; logits agree
to rounding (inductor sums some elementwise chains in another order), not bitwise.
"""
from __future__ import annotations

import contextlib
import functools

from typing import Callable, Iterator, Sequence

import torch

from megamoe.layers.cache.decode import InferenceCache
from megamoe.model.moe_controls import recording, routers
from megamoe.core.errors import ConfigError


def pick(logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: int, top_p: float,
         generator: torch.Generator | None) -> torch.Tensor:
    """logits [b, V] (fp32) -> token ids [b]."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits / max(temperature, 1e-6)
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths -> ids [b, T] (left-padded with ``pad_id``) and pad [b]."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("prompts: every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
    pad = torch.tensor([longest - len(p) for p in prompts], dtype=torch.long, device=device)
    return ids, pad


def prefill(forward, ids: torch.Tensor, cache: InferenceCache, chunk: int | None, **kwargs) -> torch.Tensor:
    """Run the prompt ids [b, T] through ``forward`` (the model, or ``StageForward`` of a
    pipeline) in chunks of ``chunk`` time steps (all at once when None); returns the last
    position's logits [b, V] (fp32). Images go with the first chunk."""
    step = ids.size(1) if not chunk else chunk
    for lo in range(0, ids.size(1), step):
        logits = forward(ids[:, lo:lo + step], cache=cache, **kwargs)
        kwargs = {}
    return logits[:, -1].float()


@torch.no_grad()
def stream(model, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int, *, do_sample: bool = False,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_token_id: int | None = None,
           seed: int | None = None, images=None, suppress_tokens: list[int] | None = None,
           prefill_chunk: int | None = None, cache_factory: Callable[..., InferenceCache] = InferenceCache,
           forward: Callable[..., torch.Tensor] | None = None,
           compile: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (rows [n], tokens [n]) once per step: the prompt indices still decoding and the token
    each produced. A row stops after EOS or ``max_new_tokens``. ``suppress_tokens`` are never
    generated; a multimodal model's image placeholder is always suppressed (a generated one has
    no image behind it). ``cache_factory(batch_size, pad=...)`` makes the cache (e.g. paged);
    ``forward(ids, cache=...)`` -> logits [b, s, V] runs the model (default: ``model`` itself;
    ``megamoe.inference.distributed.StageForward`` for a pipeline stage). ``compile``: decode steps
    as one compiled graph (module docstring; default ``forward`` only: not pipeline stages)."""
    step_forward = compiled_forward(model, forward) if compile else forward or model
    forward = forward or model
    if isinstance(prompts, torch.Tensor):
        ids, pad = prompts, torch.zeros(prompts.size(0), dtype=torch.long, device=prompts.device)
    else:
        device = getattr(next(model.parameters(), None), "device", None)
        ids, pad = left_pad(prompts, device=device)
    if images is not None and bool((pad > 0).any()):
        raise ConfigError("images: prompts with images must all have the same length")
    cache = cache_factory(ids.size(0), pad=pad)
    if compile and hasattr(cache, "reserve"):  # a paged cache: blocks for the whole generation, a step is one graph
        reserve_for_compile(model, cache, ids.size(1) + max_new_tokens)
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=ids.device).manual_seed(seed) if seed is not None else None
    suppress = list(suppress_tokens or [])
    if getattr(model, "image_token_id", None) is not None:
        suppress.append(model.image_token_id)

    def masked(logits):
        if suppress:
            logits[:, suppress] = float("-inf")
        return logits

    try:
        logits = masked(prefill(forward, ids, cache, prefill_chunk, **({"images": images} if images is not None else {})))
        rows = torch.arange(ids.size(0), device=ids.device)
        moe_routers = routers(model)
        for i in range(max_new_tokens):
            token = pick(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                         generator=generator)
            yield rows, token
            keep = torch.ones_like(token, dtype=torch.bool) if eos_token_id is None else token != eos_token_id
            if i == max_new_tokens - 1 or not bool(keep.any()):
                break
            if not bool(keep.all()):  # finished rows leave the batch and free their cache
                index = keep.nonzero().squeeze(1)
                cache.select_rows(index)
                rows, token = rows[index], token[index]
            with decode_step(model, moe_routers):
                logits = masked(step_forward(token.unsqueeze(1), cache=cache)[:, -1].float())
    finally:
        model.train(was_training)


def reserve_for_compile(model, cache, steps: int) -> None:
    """A paged ``cache``'s blocks reserved for ``steps`` time steps (``PagedCache.reserve``), so a
    compiled step reads and writes them inside its graph; refused for DeepSeek-V4's layers."""
    compressed = sorted({k.mixer for k in getattr(getattr(model, "layout", None), "layers", ())} & set("WCH"))
    if compressed:
        raise ConfigError(f"compile with a paged cache: not for DeepSeek-V4's layers ({', '.join(compressed)}: "
                          f"their compressed entries are kept per row on the host); use the contiguous cache")
    cache.reserve(steps)


@contextlib.contextmanager
def decode_step(model, moe_routers=None):
    """The settings of a one-token decode step, owned here and undone after it: the model's
    backend runs its fused functions eagerly (compiled kernels were slower at these shapes) and
    the routers (``moe_routers``: ``routers(model)``, found once) do not record ``moe_metrics``
    statistics (the prefill still does)."""
    backend = getattr(getattr(model, "ctx", None), "backend", None)
    with contextlib.ExitStack() as stack:
        if backend is not None:
            stack.enter_context(backend.fusion.eager())
        stack.enter_context(recording(model if moe_routers is None else moe_routers, False))
        yield


def compiled_forward(model, forward=None) -> Callable[..., torch.Tensor]:
    """``forward(ids, cache=...)`` of ``model`` through the process's compiled decode step."""
    if forward is not None:
        raise ConfigError("compile: a compiled decode step runs the whole model; not with a custom forward "
                          "(pipeline stages)")
    from megamoe.layers.mlp.dispatch import compile_ready

    compile_ready(model)
    return functools.partial(compiled_step(), model)


@functools.cache
def compiled_step():
    """One compiled ``step(model, ids, cache)`` per process, made on first use: its graphs are
    guarded on the model and cache they were traced with, so every generation with a model
    reuses them (a new model compiles its own)."""
    return torch.compile(_step)


def _step(model, ids, cache=None):
    return model(ids, cache=cache)


def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    """The new tokens of each prompt (EOS included when produced); keywords as ``stream``."""
    out: list[list[int]] = [[] for _ in prompts]
    for rows, tokens in stream(model, prompts, max_new_tokens, **kw):
        for r, t in zip(rows.tolist(), tokens.tolist()):
            out[r].append(t)
    return out


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: int | None = None,
             **kw) -> torch.Tensor:
    """input_ids [b, t] -> [b, t + n] (n <= max_new_tokens; stops early when every row hit EOS,
    finished rows are padded with EOS). Keywords as ``stream``."""
    new = generate_batch(model, input_ids, max_new_tokens, eos_token_id=eos_token_id, **kw)
    n = max(len(t) for t in new)
    fill = eos_token_id if eos_token_id is not None else 0
    tail = torch.tensor([t + [fill] * (n - len(t)) for t in new], dtype=torch.long, device=input_ids.device)
    return torch.cat([input_ids, tail.view(len(new), n)], dim=1)
