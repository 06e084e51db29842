"""What the trainer calls: build the tokenizer and dataset from a ``DataConfig`` and iterate over
this data-parallel rank's micro-batches, step by step, from a saved ``consumed_samples``.

    tokenizer = build_tokenizer(cfg)
    data = build_train_data(cfg, global_batch_size=G, micro_batch_size=m, dp_rank=r, dp_size=D,
                            consumed_samples=saved, tokenizer=tokenizer)
    for step in range(start_step, steps):
        micro_batches = data(step * G)  # each {"input_ids": [m, s], "labels": [m, s], ("documents",
                                        # "positions": [m, s] of packed samples), ("images")}
        ...                             # save consumed_samples = (step + 1) * G with the checkpoint

Sample order and rank slices: ``megamoe.data.sampling``.
"""
from __future__ import annotations

import importlib
import logging
from typing import Iterator, Optional, Sequence

import numpy as np
from torch.utils.data import DataLoader, Dataset, Subset

from megamoe.data.blend import Blend, parse_blend
from megamoe.data.captions import ImageCaptionDataset, ImageTokens
from megamoe.data.chat import resolve_template
from megamoe.data.config import DataConfig
from megamoe.data.pretrain import PackedDataset
from megamoe.data.samples import SEQUENCE_KEYS, collate
from megamoe.data.sampling import BatchLayout, global_order
from megamoe.data.sft import PackedSFTDataset, SFTDataset
from megamoe.data.tokenizer import Tokenizer, load_tokenizer
from megamoe.core.config import ImageBoundsConfig
from megamoe.core.errors import ConfigError, DataError, MegamoeError

log = logging.getLogger(__name__)


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    return load_tokenizer(cfg.tokenizer)


def check_vocab(tokenizer: Tokenizer, vocab_size: int, path: str = "model.vocab_size") -> None:
    """The model's embedding must have a row for every id the tokenizer produces; a tokenizer
    that covers less than half of the rows is probably not the model's own (said, not refused:
    a small tokenizer on a padded vocabulary is legitimate)."""
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"{path}={vocab_size} is invalid: tokenizer {tokenizer.name} has "
                          f"{tokenizer.vocab_size} ids; must be >= {tokenizer.vocab_size}")
    if 2 * tokenizer.vocab_size < vocab_size:
        log.warning("tokenizer %s has %d ids but %s=%d: rows above %d are never trained (is it the model's "
                    "tokenizer?)", tokenizer.name, tokenizer.vocab_size, path, vocab_size, tokenizer.vocab_size)


def load_generator(spec: str):
    """``"module:function"`` -> the function (e.g. ``megamoe.data.shapes:...``)."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"data.generator={spec!r} is invalid: cannot import it ({e})") from None


def build_dataset(cfg: DataConfig, tokenizer: Optional[Tokenizer] = None,
                  image_tokens: Optional[ImageTokens] = None, paths: Optional[Sequence[str]] = None,
                  image_bounds: Optional[ImageBoundsConfig] = None) -> Dataset:
    """The dataset ``cfg.kind`` describes over ``paths`` (default ``cfg.paths``): a ``Blend`` when
    they carry weights (Megatron's ``[w1, path1, w2, path2, ...]``, see ``megamoe.data.blend``);
    ``image_tokens`` overrides ``cfg.image_tokens``; images are opened within ``image_bounds``
    (the model's ``vision.bounds``; default ``ImageBoundsConfig()``)."""
    cfg.validate()
    tokenizer = tokenizer or build_tokenizer(cfg)
    field = "data.paths" if paths is None else "eval.paths"
    names, weights = parse_blend(cfg.paths if paths is None else paths, field)
    if weights is None:
        return _one_dataset(cfg, tokenizer, image_tokens, names, image_bounds)
    blend = Blend([_one_dataset(cfg, tokenizer, image_tokens, [name], image_bounds) for name in names], weights, names)
    log.info("%s: a blend of %s", field, blend.describe())
    return blend


def _one_dataset(cfg: DataConfig, tokenizer: Tokenizer, image_tokens: Optional[ImageTokens],
                 paths: Sequence[str], image_bounds: Optional[ImageBoundsConfig] = None) -> Dataset:
    if cfg.kind == "synthetic":
        from megamoe.data.synthetic import SyntheticDataset

        return SyntheticDataset(tokenizer.vocab_size, cfg.seq_len, seed=cfg.seed)
    if cfg.kind == "pretrain":
        dataset = PackedDataset(paths, cfg.seq_len, tokenizer, reset_at_eos=cfg.reset_at_eos,
                                eos_mask_loss=cfg.eos_mask_loss)
        log.info("pretrain data: %d windows of %d tokens from %d token file(s); %s", len(dataset), cfg.seq_len,
                 len(paths), dataset.describe())
        return dataset
    if cfg.kind == "sft":
        template = resolve_template(cfg.chat_template, tokenizer)
        kind = PackedSFTDataset if cfg.pack else SFTDataset
        return kind(paths, tokenizer, cfg.seq_len, template, cfg.truncation, cfg.split_special_tokens)
    kwargs = dict(image_token=cfg.image_token, image_tokens=image_tokens or cfg.image_tokens,
                  truncation=cfg.truncation, bounds=image_bounds)
    if cfg.generator is not None:
        pairs = load_generator(cfg.generator)(num_samples=cfg.generator_samples, seed=cfg.seed)
        return ImageCaptionDataset.from_pairs(pairs, tokenizer, cfg.seq_len, name=cfg.generator, **kwargs)
    return ImageCaptionDataset.from_jsonl(paths, tokenizer, cfg.seq_len, image_root=cfg.image_root, **kwargs)


def holdout(dataset: Dataset, fraction: float) -> tuple[Dataset, Dataset]:
    """(training, validation): the last ``fraction`` of the dataset, deterministic and disjoint.
    Token streams are cut at a document start (no token in both), a blend is cut per dataset
    (both halves keep the weights), record datasets by record (the tail of the files' order)."""
    if isinstance(dataset, Blend):
        return dataset.holdout(fraction, holdout)
    if isinstance(dataset, PackedDataset):
        return dataset.holdout(fraction)
    n = len(dataset)
    k = int(round(n * fraction))
    if not 0 < k < n:
        raise DataError(f"eval.split={fraction} of {n} samples leaves {k} for validation and {n - k} for training; "
                        "both need at least one")
    return Subset(dataset, range(n - k)), Subset(dataset, range(n - k, n))


def build_datasets(cfg: DataConfig, tokenizer: Optional[Tokenizer] = None, image_tokens: Optional[ImageTokens] = None,
                   eval_paths: Sequence[str] = (), eval_split: float = 0.0,
                   image_bounds: Optional[ImageBoundsConfig] = None) -> tuple[Dataset, Optional[Dataset]]:
    """Training and validation datasets: validation from ``eval_paths`` (the same kind, tokenizer
    and seq_len; weights allowed), or the held-out last ``eval_split`` of the training data, or none."""
    tokenizer = tokenizer or build_tokenizer(cfg)
    train = build_dataset(cfg, tokenizer, image_tokens, image_bounds=image_bounds)
    if eval_paths:
        return train, build_dataset(cfg, tokenizer, image_tokens, paths=eval_paths, image_bounds=image_bounds)
    if eval_split > 0:
        train, valid = holdout(train, eval_split)
        log.info("validation: the last %g of the training data held out (%d samples; %d left to train on)",
                 eval_split, len(valid), len(train))
        return train, valid
    return train, None


def sample_items(dataset: Dataset, samples: np.ndarray, seed: int, shuffle: bool) -> np.ndarray:
    """Dataset items of global sample indices: a blend's weighted order, else ``global_order``."""
    if isinstance(dataset, Blend):
        return dataset.order(samples, seed, shuffle)
    return global_order(samples, len(dataset), seed, shuffle)


class StepSampler:
    """Endless batch sampler of a rank's micro-batches from ``start``. The DataLoader may read
    ahead of the trainer; ``TrainData.consumed_samples`` counts only the steps returned."""

    def __init__(self, data: "TrainData", start: int):
        self.data, self.start = data, start

    def __iter__(self):
        consumed = self.start
        while True:
            for micro in self.data.step_indices(consumed):
                yield micro.tolist()
            consumed += self.data.layout.global_batch_size


class TrainData:
    """One data-parallel rank's micro-batches, step by step.

    ``data(consumed_samples)`` returns the ``layout.num_micro_batches`` collated micro-batches of
    the step that starts at ``consumed_samples`` (the trainer's ``BatchSource``); calls with
    consecutive positions stream from one DataLoader (workers read ahead), any other position
    restarts it there. ``next(data)`` continues from ``data.consumed_samples``."""

    def __init__(self, dataset: Dataset, layout: BatchLayout, seed: int, shuffle: bool = True,
                 consumed_samples: int = 0, num_workers: int = 0):
        self.dataset, self.layout, self.seed, self.shuffle = dataset, layout, seed, shuffle
        self.num_items, self.num_workers = len(dataset), num_workers
        self._start(consumed_samples)

    def _start(self, consumed_samples: int) -> None:
        if not isinstance(consumed_samples, int) or consumed_samples < 0:
            raise ConfigError(f"consumed_samples={consumed_samples!r} is invalid: must be an integer >= 0")
        self.consumed_samples = consumed_samples
        loader = DataLoader(self.dataset, batch_sampler=StepSampler(self, consumed_samples), collate_fn=collate,
                            num_workers=self.num_workers)
        self._it: Iterator = iter(loader)

    def step_indices(self, consumed_samples: int) -> list[np.ndarray]:
        """Dataset items of this rank's micro-batches in the step starting at ``consumed_samples``."""
        return [sample_items(self.dataset, m, self.seed, self.shuffle)
                for m in self.layout.micro_batches(consumed_samples)]

    def __call__(self, consumed_samples: int) -> list[dict]:
        if consumed_samples != self.consumed_samples:
            self._start(consumed_samples)
        return next(self)

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        try:
            batches = [next(self._it) for _ in range(self.layout.num_micro_batches)]
        except MegamoeError as e:
            raise from_worker(e) from None
        self.consumed_samples += self.layout.global_batch_size
        return batches


def from_worker(e: MegamoeError) -> MegamoeError:
    """A bad-input error raised in a DataLoader worker as its one line: torch re-raises it in the
    main process with the worker's whole traceback as the message, whose last line is
    ``module.Class: message``."""
    lines = str(e).rstrip().splitlines()
    prefix = f"{type(e).__module__}.{type(e).__qualname__}: "
    if len(lines) > 1 and "DataLoader worker" in lines[0] and lines[-1].startswith(prefix):
        return type(e)(lines[-1][len(prefix):])
    return e


def build_train_data(cfg: DataConfig, *, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0,
                     dp_size: int = 1, consumed_samples: int = 0, tokenizer: Optional[Tokenizer] = None,
                     image_tokens: Optional[ImageTokens] = None, dataset: Optional[Dataset] = None) -> TrainData:
    """The trainer's entry point: this rank's step iterator, resuming at ``consumed_samples``."""
    layout = BatchLayout(global_batch_size, micro_batch_size, dp_size, dp_rank)
    dataset = dataset if dataset is not None else build_dataset(cfg, tokenizer, image_tokens)
    return TrainData(dataset, layout, cfg.seed, cfg.shuffle, consumed_samples, cfg.num_workers)


def concat_micro_batches(batches: list[dict]) -> dict:
    """A rank's micro-batches of one step as one batch [G/D, s] (e.g. for a pipeline schedule,
    which splits it again into the same micro-batches, in order)."""
    import torch

    out = {k: torch.cat([b[k] for b in batches]) for k in SEQUENCE_KEYS if k in batches[0]}
    if "images" in batches[0]:
        out["images"] = [img for b in batches for img in b["images"]]
    return out
