"""Greedy and sampled decoding with the mixers' shared decode cache.

The prompt is processed in one forward (prefill); every new token then runs one step that
reads and extends each mixer's cache (KV for softmax/MLA/DSA, conv + recurrent state for
linear mixers). Under tensor parallelism every rank gets the full logits and, with the same
seed, picks the same token.
"""
from __future__ import annotations

import torch

from megamoe.cache import InferenceCache


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


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_token_id: int | None = None,
             seed: int | None = None, images=None, suppress_tokens: list[int] | None = None) -> torch.Tensor:
    """input_ids [b, t] -> [b, t + n] (n <= max_new_tokens; stops early when every row hit EOS,
    finished rows are padded with EOS). ``suppress_tokens`` are never generated; a multimodal
    model's image placeholder is always suppressed (a generated one has no image behind it)."""
    was_training = model.training
    model.eval()
    cache = InferenceCache(input_ids.size(0))
    generator = torch.Generator(device=input_ids.device).manual_seed(seed) if seed is not None else None
    kwargs = {"images": images} if images is not None else {}
    suppress = list(suppress_tokens or [])
    if getattr(model, "image_token_id", None) is not None:
        suppress.append(model.image_token_id)

    def last_logits(x, **kw):
        logits = model(x, cache=cache, **kw)[:, -1].float()
        if suppress:
            logits[:, suppress] = float("-inf")
        return logits

    logits = last_logits(input_ids, **kwargs)
    out = [input_ids]
    done = torch.zeros(input_ids.size(0), dtype=torch.bool, device=input_ids.device)
    for i in range(max_new_tokens):
        token = pick(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                     generator=generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done |= token == eos_token_id
        out.append(token.unsqueeze(1))
        if (eos_token_id is not None and bool(done.all())) or i == max_new_tokens - 1:
            break
        logits = last_logits(token.unsqueeze(1))
    model.train(was_training)
    return torch.cat(out, dim=1)
