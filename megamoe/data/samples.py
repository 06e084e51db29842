"""Turning one tokenised record into a fixed-length training sample, and batching samples.

Sample: ``input_ids`` LongTensor[s], ``labels`` LongTensor[s] with ``labels[t]`` the target of
position t (``ids[t+1]`` when that token is trainable, else -100) — already shifted, as
``megamoe.model.language_model.shift_labels`` does for plain text. Shorter records are padded on the right
with the tokenizer's pad id (labels -100); longer ones follow the truncation policy:

- ``right``: keep the first ``seq_len`` tokens (the targets of the kept positions stay; a reply
  cut off mid-way is trained on its kept part). Truncated records are counted and logged.
- ``error``: a one-line ``FILE:LINE`` error naming the record's length.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from megamoe.data.records import data_error
from megamoe.parallel.cross_entropy import IGNORE_INDEX

log = logging.getLogger(__name__)

TRUNCATION = ("right", "error")


class Truncations:
    """Counts truncated records so a run reports how many it cut (once per power of two)."""

    def __init__(self):
        self.count = 0

    def add(self, where: str, length: int, seq_len: int) -> None:
        self.count += 1
        if self.count & (self.count - 1) == 0:
            log.warning("%s: %d tokens truncated to seq_len=%d (%d records truncated so far)",
                        where, length, seq_len, self.count)


def make_sample(ids: Sequence[int], trainable: Sequence[bool], seq_len: int, pad_id: int, truncation: str,
                where: tuple, counter: Truncations | None = None) -> dict:
    """Pad or truncate one record to ``seq_len``; ``where`` is (file, line) for messages."""
    if len(ids) > seq_len:
        if truncation == "error":
            raise data_error(*where, f"record has {len(ids)} tokens, more than seq_len={seq_len} "
                                     "(truncation='error'; use 'right' to cut it)")
        if counter is not None:
            counter.add(f"{where[0]}:{where[1]}", len(ids), seq_len)
    n = min(len(ids), seq_len)
    input_ids = torch.full((seq_len,), pad_id, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    input_ids[:n] = torch.as_tensor(list(ids[:n]), dtype=torch.long)
    targets = torch.as_tensor(list(ids[1:n + 1]), dtype=torch.long)
    keep = torch.as_tensor(list(trainable[1:n + 1]), dtype=torch.bool)
    labels[: len(targets)] = torch.where(keep, targets, torch.full_like(targets, IGNORE_INDEX))
    return {"input_ids": input_ids, "labels": labels}


def pack_samples(parts: list[dict], seq_len: int, pad_id: int) -> dict:
    """Unpadded samples (each ending with label -100, so no target crosses into the next) -> one
    sample of ``seq_len`` with ``documents`` (the part number of every token; the padding is
    one more) and ``positions`` (0 at each part's first token)."""
    ids, labels, documents, positions = [], [], [], []
    for d, part in enumerate(parts + [None]):
        n = seq_len - sum(len(x) for x in ids) if part is None else len(part["input_ids"])
        if n == 0:
            continue
        ids.append(torch.full((n,), pad_id, dtype=torch.long) if part is None else part["input_ids"])
        labels.append(torch.full((n,), IGNORE_INDEX, dtype=torch.long) if part is None else part["labels"])
        documents.append(torch.full((n,), d, dtype=torch.long))
        positions.append(torch.arange(n))
    return {"input_ids": torch.cat(ids), "labels": torch.cat(labels), "documents": torch.cat(documents),
            "positions": torch.cat(positions)}


SEQUENCE_KEYS = ("input_ids", "labels", "documents", "positions")  # [s] per sample, [b, s] batched


def collate(samples: list[dict]) -> dict:
    """Stack tensors into [b, s]; ``image`` entries become the list ``images`` (one per sample)."""
    batch = {key: torch.stack([s[key] for s in samples]) for key in SEQUENCE_KEYS if key in samples[0]}
    if "image" in samples[0]:
        batch["images"] = [s["image"] for s in samples]
    return batch
