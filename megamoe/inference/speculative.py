"""Speculative greedy decoding with the model's own multi-token-prediction depths as the draft.

Each step drafts D tokens (D = ``model.mtp.num_layers``) with the MTP chain from the last
verified position, then runs the main model once over the newest token and the drafts: a draft
is accepted while it equals the main model's greedy choice, and the main model's token after
the accepted ones comes for free, so a step yields 1 .. D+1 tokens, each exactly the token plain
greedy decoding gives (up to the rounding of a multi-token forward against one-token steps).

Rows of a batch advance together: a step accepts the drafts every row accepted (rows that would
accept more get those tokens again from the next step). Rejected drafts leave the main cache:
it is restored to before the verify forward and the accepted tokens are run again (exact for
every mixer, linear ones included: their recurrent state cannot be cut back).

The MTP depths keep their own decode caches (one ``InferenceCache`` each, the prompt's padding).
Depth k at time i reads the hidden state h^k_i and the token at i+k+1, so it can commit times
whose token i+k+1 is verified; the later times it runs on the drafts of the depths before it,
in a forward whose cache changes are undone (``InferenceCache.snapshot``/``restore``).

Shapes: ids [b, t]; hidden [b, t, h]; logits [b, t, V] (fp32).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from megamoe.layers.cache.decode import InferenceCache
from megamoe.core.errors import ConfigError
from megamoe.inference.generate import decode_step, left_pad
from megamoe.model.moe_controls import routers
from megamoe.model.mtp import run_depth
from megamoe.layers.spec import ForwardInfo


@dataclass
class SpeculativeStats:
    """What the draft bought: ``accepted[s]`` drafts accepted at verify step s, of ``drafts`` each."""

    drafts: int = 0
    accepted: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verify step yields on average (1 + accepted drafts)."""
        return 1.0 + sum(self.accepted) / max(len(self.accepted), 1)

    def summary(self) -> str:
        return (f"speculative (mtp, {self.drafts} draft(s) per step): {len(self.accepted)} verify steps, "
                f"{self.tokens_per_step:.2f} tokens per step; accepted tokens per step: "
                f"{' '.join(str(1 + a) for a in self.accepted)}")


def main_forward(model, ids: torch.Tensor, cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The main model on ids [b, t] after what ``cache`` holds: (fp32 logits [b, t, V], the
    final-normed hidden states [b, t, h] the MTP depths read)."""
    info = ForwardInfo(positions=model.default_positions(ids, None, cache), cache=cache)
    hidden = model.final_norm(model.run_layers(model.embed(ids), info))
    cache.advance(ids.size(1))
    return model.gather_logits(model.output(hidden)).float(), hidden


def depth_forward(model, depth: int, hidden: torch.Tensor, ahead: torch.Tensor,
                  cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth ``depth`` over the next times of its ``cache``: h^k [b, t, h] and the tokens k+1
    ahead [b, t] -> (h^{k+1}, fp32 logits [b, t, V])."""
    info = ForwardInfo(positions=cache.positions(ahead.size(1), ahead.device), cache=cache)
    hidden, logits = run_depth(model, depth, hidden, ahead, info)
    cache.advance(ahead.size(1))
    return hidden, model.gather_logits(logits).float()


class _Drafter:
    """The MTP depths' caches and the hidden states each depth has still to read."""

    def __init__(self, model, batch: int, pad: torch.Tensor, masked):
        self.model, self.masked = model, masked
        self.depths = len(model.mtp)
        self.caches = [InferenceCache(batch, pad=pad) for _ in range(self.depths)]
        self.pending: list[torch.Tensor | None] = [None] * self.depths  # depth k's inputs from time caches[k].seen

    def feed(self, hidden: torch.Tensor) -> None:
        """The main model's hidden states of the times after the last fed."""
        self.pass_on(0, hidden)

    def draft(self, seq: torch.Tensor) -> torch.Tensor:
        """D greedy drafts [b, D] for the times after ``seq`` [b, L] (the verified tokens; the
        main model has read all but the last)."""
        last, drafts, provisional = seq.size(1) - 2, [], None
        for k in range(self.depths):
            ext = torch.cat([seq, *drafts], 1) if drafts else seq
            cache, commit_to = self.caches[k], last - k  # depth k commits times whose token k+1 ahead is verified
            logits = None
            if commit_to >= cache.seen:
                n = commit_to + 1 - cache.seen
                out, logits = depth_forward(self.model, k, self.pending[k][:, :n], ext[:, cache.seen + k + 1:][:, :n],
                                            cache)
                self.pending[k] = self.pending[k][:, n:]
                if k + 1 < self.depths:
                    self.pass_on(k + 1, out)
            inputs = _joined(self.pending[k], provisional)
            if inputs is not None and inputs.size(1):  # the later times, on the drafts so far; undone afterwards
                saved = cache.snapshot()
                provisional, logits = depth_forward(self.model, k, inputs, ext[:, cache.seen + k + 1:], cache)
                cache.restore(saved)
            else:
                provisional = None
            drafts.append(self.masked(logits[:, -1]).argmax(-1, keepdim=True))
        return torch.cat(drafts, 1)

    def pass_on(self, k: int, hidden: torch.Tensor) -> None:
        """Hidden states depth k reads next (after those it has still to read)."""
        self.pending[k] = _joined(self.pending[k], hidden)

    def select_rows(self, index: torch.Tensor) -> None:
        for cache in self.caches:
            cache.select_rows(index)
        self.pending = [None if p is None else p.index_select(0, index) for p in self.pending]


def _joined(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """[b, t, h] pieces in time order (None: nothing)."""
    return b if a is None else a if b is None else torch.cat([a, b], 1)


def _check(model) -> None:
    if getattr(model, "mtp", None) is None:
        raise ConfigError("--speculative mtp: the model has no multi-token-prediction layers (model.mtp)")
    if not (model.pre_process and model.post_process):
        raise ConfigError("--speculative mtp: decoding with MTP drafts runs the whole model in one process "
                          "(not a pipeline stage)")


@torch.no_grad()
def stream_speculative(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       eos_token_id: int | None = None, suppress_tokens: list[int] | None = None,
                       prefill_chunk: int | None = None,
                       stats: SpeculativeStats | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy decoding as ``megamoe.inference.generate.stream`` (same yields: (rows [n], tokens [n]) once
    per token position), drafted by the MTP depths; ``stats`` collects the accepted drafts."""
    _check(model)
    device = getattr(next(model.parameters(), None), "device", None)
    ids, pad = left_pad(prompts, device=device)
    stats = stats if stats is not None else SpeculativeStats()
    stats.drafts = len(model.mtp)
    suppress = list(suppress_tokens or [])

    def masked(logits):
        if suppress:
            logits[..., suppress] = float("-inf")
        return logits

    was_training = model.training
    model.eval()
    cache, drafter = InferenceCache(ids.size(0), pad=pad), _Drafter(model, ids.size(0), pad, masked)
    moe_routers = routers(model)
    try:
        step = ids.size(1) if not prefill_chunk else prefill_chunk
        for lo in range(0, ids.size(1), step):
            logits, hidden = main_forward(model, ids[:, lo:lo + step], cache)
            drafter.feed(hidden)
        seq = torch.cat([ids, masked(logits[:, -1]).argmax(-1, keepdim=True)], 1)
        rows = torch.arange(ids.size(0), device=ids.device)
        yield from _decode(model, seq, rows, cache, drafter, masked, max_new_tokens, eos_token_id, stats, moe_routers)
    finally:
        model.train(was_training)


def _decode(model, seq, rows, cache, drafter, masked, max_new_tokens, eos, stats, moe_routers):
    """The verify loop after the prefill; ``seq``'s last token is the first new one. A row leaves
    the batch after its EOS (the tokens a step accepted after it are not given)."""
    new, given = seq[:, -1:], 0
    while True:
        alive = torch.ones(new.size(0), dtype=torch.bool, device=new.device)
        for i in range(new.size(1)):
            index = alive.nonzero().squeeze(1)
            yield rows[index], new[index, i]
            given += 1
            if given == max_new_tokens:
                return
            if eos is not None:
                alive &= new[:, i] != eos
            if not bool(alive.any()):
                return
        if not bool(alive.all()):
            keep = alive.nonzero().squeeze(1)
            cache.select_rows(keep)
            drafter.select_rows(keep)
            seq, rows = seq.index_select(0, keep), rows[keep]
        with decode_step(model, moe_routers):
            new, seq = _verify(model, seq, drafter.draft(seq), cache, drafter, masked, stats)


def _verify(model, seq, drafts, cache, drafter, masked, stats):
    """Run the newest token and the drafts [b, D]; keep what every row's greedy choice agrees
    with. Returns (the new tokens [b, j+1], the verified sequence)."""
    saved = cache.snapshot()
    logits, hidden = main_forward(model, torch.cat([seq[:, -1:], drafts], 1), cache)
    greedy = masked(logits).argmax(-1)  # [b, D+1]: the token after each fed one
    agree = (greedy[:, :-1] == drafts).all(0).long()
    j = int(agree.cumprod(0).sum())
    stats.accepted.append(j)
    if j < drafts.size(1):  # the rejected drafts leave the cache: run the accepted ones again
        cache.restore(saved)
        _, hidden = main_forward(model, torch.cat([seq[:, -1:], drafts[:, :j]], 1), cache)
    drafter.feed(hidden)
    new = torch.cat([drafts[:, :j], greedy[:, j:j + 1]], 1)
    return new, torch.cat([seq, new], 1)
