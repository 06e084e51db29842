"""Sequence packing for pretraining: fixed windows over the concatenated documents.

The token stream of a token file is its documents back to back, each ending with EOS. Sample j
is the window ``stream[j*s : j*s + s + 1]`` (s = seq_len): ``input_ids = window[:-1]``,
``labels = window[1:]``. Consecutive windows share one token, so every token after the first is
a target exactly once; a window may span document boundaries (EOS separates them; attention is
not reset at the boundary). Windows never span two token files; a file's last partial window
is not used. Samples are a pure function of (files, seq_len): deterministic.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from megamoe.data.tokenizer import Tokenizer
from megamoe.data.tokfile import TokenFile
from megamoe.errors import DataError


class PackedDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens from one or more token directories, in file order.

    ``item -> {"input_ids": LongTensor[s], "labels": LongTensor[s]}``."""

    def __init__(self, paths: Sequence[str | Path], seq_len: int, tokenizer: Optional[Tokenizer] = None):
        self.files = [TokenFile(p) for p in paths]
        for f in self.files:
            f.check_tokenizer(tokenizer)
        self.seq_len = seq_len
        counts = [max(0, (f.num_tokens - 1) // seq_len) for f in self.files]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.starts[-1] == 0:
            total = sum(f.num_tokens for f in self.files)
            raise DataError(f"{', '.join(map(str, paths))}: {total} tokens, fewer than seq_len+1={seq_len + 1}")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        f = int(np.searchsorted(self.starts, index, side="right")) - 1
        begin = (index - int(self.starts[f])) * self.seq_len
        return np.asarray(self.files[f].tokens[begin:begin + self.seq_len + 1], dtype=np.int64)

    def __getitem__(self, index: int) -> dict:
        w = torch.from_numpy(self.window(index))
        return {"input_ids": w[:-1], "labels": w[1:]}
