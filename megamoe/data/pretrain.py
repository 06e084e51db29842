"""Sequence packing for pretraining: fixed windows over the concatenated documents.

The token stream of a token file (a megamoe token directory, or a Megatron indexed dataset's
``.bin``, see ``megamoe.data.indexed``) is its documents back to back, each ending with EOS. Sample j
is the window ``stream[j*s : j*s + s + 1]`` (s = seq_len): ``input_ids = window[:-1]``,
``labels = window[1:]``. Consecutive windows share one token, so every token after the first is
a target exactly once; a window may span document boundaries. Windows never span two token
files; a file's last partial window is not used. Samples are a pure function of (files,
seq_len, options): deterministic.

By default attention runs across the EOS that separates two documents of a window (Megatron's
default). Options, as Megatron's flags of the same meaning:

- ``reset_at_eos`` (``--reset-position-ids --reset-attention-mask``): a new document starts
  after every EOS input token; the sample also carries ``documents`` (document number of every
  token, 0 for the window's first) and ``positions`` (0 at each document's first token), which
  every mixer reads to keep the documents apart (``ForwardInfo.documents``). The EOS belongs to
  the document it ends, so its target (the next document's first token) is predicted from that
  document alone.
- ``eos_mask_loss`` (``--eod-mask-loss``): no loss at EOS input positions, i.e. the label of
  every position whose input token is EOS is -100 (Megatron's ``loss_mask[tokens == eod] = 0``).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from megamoe.data.tokenizer import Tokenizer
from megamoe.core.errors import DataError
from megamoe.parallel.context import position_in_document
from megamoe.parallel.cross_entropy import IGNORE_INDEX


def stream_eos_id(sources: Sequence, tokenizer: Optional[Tokenizer] = None) -> int:
    """The EOS id that ends every document of ``sources`` (token directories: their headers, which
    ``check_tokenizer`` matches against the run's tokenizer; indexed datasets: the tokenizer's)."""
    ids = {str(src.path): src.eos_id(tokenizer) for src in sources}
    if len(set(ids.values())) > 1:
        raise DataError(f"{', '.join(ids)}: documents end with different EOS ids {sorted(set(ids.values()))}")
    return next(iter(ids.values()))


def document_layout(input_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``documents`` and ``positions`` (both LongTensor[s]) of input ids [s] whose documents end
    with ``eos_id``: a new document starts after every EOS (the first token is document 0)."""
    eos = (input_ids == eos_id).long()
    documents = torch.cumsum(eos, 0) - eos  # EOS tokens before t, not counting t itself
    return documents, position_in_document(documents[None])[0]


class Stream(NamedTuple):
    """Tokens ``[begin, end)`` of one token source (a token directory or an indexed dataset)."""

    source: object
    begin: int
    end: int

    def windows(self, seq_len: int) -> int:
        return max(0, (self.end - self.begin - 1) // seq_len)


class PackedDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens from one or more token sources, in file order: megamoe
    token directories or Megatron indexed datasets (``prefix`` of ``prefix.bin`` + ``.idx``).

    ``item -> {"input_ids": LongTensor[s], "labels": LongTensor[s]}``, plus ``documents`` and
    ``positions`` (LongTensor[s]) with ``reset_at_eos``. ``holdout(fraction)`` splits every
    source at a document start into a training and a validation dataset that share no token."""

    def __init__(self, paths: Sequence[str | Path], seq_len: int, tokenizer: Optional[Tokenizer] = None, *,
                 reset_at_eos: bool = False, eos_mask_loss: bool = False, streams: Sequence[Stream] = ()):
        from megamoe.data.indexed import open_token_source

        self.streams = list(streams) or [Stream(src, 0, src.num_tokens)
                                          for src in (open_token_source(p, tokenizer) for p in paths)]
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.reset_at_eos, self.eos_mask_loss = reset_at_eos, eos_mask_loss
        sources = [st.source for st in self.streams]
        self.eos_id = stream_eos_id(sources, tokenizer) if reset_at_eos or eos_mask_loss else None
        counts = [st.windows(seq_len) for st in self.streams]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.starts[-1] == 0:
            total = sum(st.end - st.begin for st in self.streams)
            names = ", ".join(str(src.path) for src in sources)
            raise DataError(f"{names}: {total} tokens, fewer than seq_len+1={seq_len + 1}")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def describe(self) -> str:
        """How documents meet inside a window (for the run's log)."""
        apart = (f"documents kept apart after every EOS (id {self.eos_id})" if self.reset_at_eos
                 else "attention runs across EOS")
        return apart + (", no loss at EOS inputs" if self.eos_mask_loss else "")

    def holdout(self, fraction: float) -> tuple["PackedDataset", "PackedDataset"]:
        """(training, validation): the last ``fraction`` of every source's tokens, from the first
        document start at or after the cut, is validation (Megatron's ``--split`` cuts by documents
        in the same way); deterministic, and the two share no token."""
        train, valid = [], []
        for st in self.streams:
            cut = st.source.doc_start_at_or_after(st.begin + int(round((st.end - st.begin) * (1.0 - fraction))))
            cut = min(max(cut, st.begin), st.end)
            for part, (a, b) in ((train, (st.begin, cut)), (valid, (cut, st.end))):
                if b - a < self.seq_len + 1:
                    raise DataError(f"{st.source.path}: eval.split={fraction} leaves {b - a} tokens for "
                                    f"{'training' if part is train else 'validation'}, fewer than seq_len+1="
                                    f"{self.seq_len + 1} (documents are not cut)")
                part.append(Stream(st.source, a, b))
        return self._with(train), self._with(valid)

    def _with(self, streams: list[Stream]) -> "PackedDataset":
        return PackedDataset((), self.seq_len, self.tokenizer, reset_at_eos=self.reset_at_eos,
                             eos_mask_loss=self.eos_mask_loss, streams=streams)

    def window(self, index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        f = int(np.searchsorted(self.starts, index, side="right")) - 1
        st = self.streams[f]
        return st.source.read(st.begin + (index - int(self.starts[f])) * self.seq_len, self.seq_len + 1)
    def __getitem__(self, index: int) -> dict:
        w = torch.from_numpy(self.window(index))
        sample = {"input_ids": w[:-1], "labels": w[1:]}
        if self.eos_mask_loss:
            sample["labels"] = sample["labels"].masked_fill(sample["input_ids"] == self.eos_id, IGNORE_INDEX)
        if self.reset_at_eos:
            sample["documents"], sample["positions"] = document_layout(sample["input_ids"], self.eos_id)
        return sample
