"""Synthetic token data (Megatron's "mock data"): no files, deterministic, learnable.

Sample i is an arithmetic progression modulo the vocabulary with a start and stride drawn
from (seed, i): ``ids[t] = (start + stride * t) % vocab``. A model can learn it (the loss
falls well below ln V), which makes it useful for smoke runs, benchmarks and layout-parity
tests, where the data must be identical whatever the layout.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from megamoe.data.sampling import _splitmix


class SyntheticDataset(Dataset):
    def __init__(self, vocab_size: int, seq_len: int, num_samples: int = 1 << 20, seed: int = 0,
                 max_stride: int = 7):
        self.vocab, self.seq_len, self.n, self.seed, self.max_stride = vocab_size, seq_len, num_samples, seed, max_stride

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        h = int(_splitmix(np.array([(self.seed << 40) ^ int(index)], dtype=np.uint64))[0])
        start, stride = h % self.vocab, 1 + (h >> 32) % self.max_stride
        ids = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab
        return {"input_ids": ids[:-1].clone(), "labels": ids[1:].clone()}
