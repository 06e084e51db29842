"""Megatron-LM's indexed datasets: ``prefix.bin`` (every document's tokens back to back) and
``prefix.idx`` (dtype, sequence lengths and byte offsets, document boundaries), as Megatron's
``tools/preprocess_data.py`` writes them and its ``--data-path`` names them (the prefix).

Reading goes through megatron-core's own ``IndexedDataset`` (memory-mapped; it runs on CPU):
its index gives the dtype and the document starts, its bin reader the tokens. A pretraining
stream reads the ``.bin`` as one token stream in file order, as a megamoe token directory is
read (``megamoe.data.pretrain``). Writing goes through megatron-core's ``IndexedDatasetBuilder``
(``megamoe-prepare-data --format megatron``), one sequence per document, each ending with EOS
(Megatron's ``--append-eod``).

The files record no tokenizer: a window whose ids reach past the run's tokenizer is a one-line
error naming the file, and ``data.reset_at_eos`` / ``data.eos_mask_loss`` need documents that
end with the tokenizer's EOS (checked on the first and last document).
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from megamoe.data.tokenizer import Tokenizer
from megamoe.core.errors import DataError

log = logging.getLogger(__name__)

BIN, IDX = ".bin", ".idx"


def is_indexed_prefix(path: str | Path) -> bool:
    """``path`` names a Megatron indexed dataset: ``path.bin`` and ``path.idx`` exist."""
    return Path(f"{path}{BIN}").is_file() and Path(f"{path}{IDX}").is_file()


def _megatron_indexed():
    import warnings

    with warnings.catch_warnings():  # megatron-core warns about optional GPU packages on import
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


class IndexedTokens:
    """A Megatron indexed dataset opened read-only as one token stream (``TokenFile``'s reading
    interface: ``num_tokens``, ``read``, ``doc_start_at_or_after``, ``check_tokenizer``)."""

    def __init__(self, prefix: str | Path, tokenizer: Optional[Tokenizer] = None):
        self.path = Path(prefix)
        missing = [f"{prefix}{ext}" for ext in (BIN, IDX) if not Path(f"{prefix}{ext}").is_file()]
        if missing:
            raise DataError(f"{missing[0]}: not found (a Megatron indexed dataset is named by its prefix: "
                            f"PREFIX{BIN} + PREFIX{IDX})")
        module = _megatron_indexed()
        with open(f"{prefix}{IDX}", "rb") as f:  # (megatron-core asserts, then fails again in __del__)
            if f.read(len(module._INDEX_HEADER)) != module._INDEX_HEADER:
                raise DataError(f"{prefix}{IDX}: not a Megatron indexed dataset (its header is not "
                                f"{module._INDEX_HEADER!r})")
        try:
            self.dataset = module.IndexedDataset(str(prefix), mmap=True)
        except (AssertionError, ValueError, OSError, KeyError) as e:
            raise DataError(f"{prefix}{IDX}: not a Megatron indexed dataset ({str(e) or type(e).__name__})") from None
        index = self.dataset.index
        self.dtype, self.itemsize = np.dtype(index.dtype), np.dtype(index.dtype).itemsize
        size = Path(f"{prefix}{BIN}").stat().st_size
        pointers, lengths = index.sequence_pointers, index.sequence_lengths
        # O(1) consistency: the sequences tile the .bin from byte 0 to its end
        if len(lengths) == 0 or int(pointers[0]) != 0 or int(pointers[-1]) + int(lengths[-1]) * self.itemsize != size:
            raise DataError(f"{prefix}{BIN}: {size} bytes do not match its index ({len(lengths)} sequences)")
        self.num_tokens = size // self.itemsize
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else None

    @property
    def num_documents(self) -> int:
        return len(self.dataset.document_indices) - 1

    def describe(self) -> str:
        return f"{self.path} (Megatron indexed, {self.dtype.name})"

    def read(self, begin: int, count: int) -> np.ndarray:
        """Tokens ``[begin, begin + count)`` of the stream (int64), through megatron-core's bin reader."""
        out = self.dataset.bin_reader.read(dtype=self.dtype, count=count, offset=begin * self.itemsize)
        out = np.asarray(out, dtype=np.int64)
        if self.vocab_size is not None and count and (out.max() >= self.vocab_size or out.min() < 0):
            raise DataError(f"{self.path}{BIN}: token id {int(out.max())} at tokens [{begin}, {begin + count}) is "
                            f"outside the tokenizer's vocab_size={self.vocab_size} (written with another tokenizer?)")
        return out

    def document_start(self, d: int) -> int:
        """Token offset of document ``d`` (``num_documents`` gives the end of the stream)."""
        if d >= self.num_documents:
            return self.num_tokens
        seq = int(self.dataset.document_indices[d])
        return int(self.dataset.index.sequence_pointers[seq]) // self.itemsize

    def doc_start_at_or_after(self, pos: int) -> int:
        """The first document start >= token ``pos`` (binary search, O(log documents))."""
        lo, hi = 0, self.num_documents
        while lo < hi:
            mid = (lo + hi) // 2
            if self.document_start(mid) < pos:
                lo = mid + 1
            else:
                hi = mid
        return self.document_start(lo)

    def check_tokenizer(self, tokenizer: Optional[Tokenizer]) -> None:
        """Nothing to compare (the files record no tokenizer); ids are checked as windows are read."""
        if tokenizer is not None:
            self.vocab_size = tokenizer.vocab_size

    def eos_id(self, tokenizer: Optional[Tokenizer]) -> int:
        """The tokenizer's EOS, which must end the first and the last document (Megatron's --append-eod)."""
        if tokenizer is None:
            raise DataError(f"{self.path}: an indexed dataset records no EOS id; data.tokenizer must give it")
        eos = tokenizer.eos_id
        for d in (0, self.num_documents - 1):
            end = self.document_start(d + 1)
            if end == 0 or int(self.read(end - 1, 1)[0]) != eos:
                raise DataError(f"{self.path}{BIN}: document {d} does not end with EOS id {eos} of tokenizer "
                                f"{tokenizer.name}; data.reset_at_eos and data.eos_mask_loss need documents "
                                "that end with it (Megatron's --append-eod)")
        return eos

    def __getstate__(self):  # DataLoader workers reopen the memory maps
        return {"path": self.path, "vocab_size": self.vocab_size}

    def __setstate__(self, state):
        vocab = state["vocab_size"]
        self.__init__(state["path"])
        self.vocab_size = vocab


def write_indexed_dataset(documents, prefix: str | Path, vocab_size: int, overwrite: bool = False) -> dict:
    """Write ``documents`` (an iterable of ``(path, docs)`` as ``tokfile.encoded_documents`` yields)
    as ``prefix.bin`` + ``prefix.idx`` with megatron-core's builder, in the dtype Megatron's
    preprocess_data picks for ``vocab_size``. Both files are written under temporary names and
    renamed when complete; an error leaves neither behind. Returns counts and sources."""
    prefix = Path(prefix)
    targets = [Path(f"{prefix}{ext}") for ext in (BIN, IDX)]
    existing = [t for t in targets if t.exists() or t.is_symlink()]
    if existing and not overwrite:
        raise DataError(f"{existing[0]}: already exists (pass --overwrite to replace it)")
    bad = [t for t in existing if t.is_symlink() or not t.is_file()]
    if bad:
        raise DataError(f"{bad[0]}: exists and is not a file; --overwrite only replaces an indexed dataset's files")
    module = _megatron_indexed()
    dtype = module.DType.optimal_dtype(vocab_size)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_bin = tempfile.mkstemp(prefix=f".{prefix.name}.tmp-", suffix=BIN, dir=prefix.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_bin, 0o666 & ~umask)  # as an ordinary new file (mkstemp's are private)
    tmp_idx = tmp_bin[: -len(BIN)] + IDX
    try:
        summary = _build(module, documents, tmp_bin, tmp_idx, dtype)
        os.replace(tmp_bin, targets[0])
        os.replace(tmp_idx, targets[1])
    except BaseException:
        for t in (tmp_bin, tmp_idx):
            Path(t).unlink(missing_ok=True)
        raise
    summary["dtype"] = np.dtype(dtype).name
    log.info("wrote %s.{bin,idx}: %d documents, %d tokens (%s)", prefix, summary["num_documents"],
             summary["num_tokens"], summary["dtype"])
    return summary


def _build(module, documents, bin_path: str, idx_path: str, dtype) -> dict:
    import torch

    builder = module.IndexedDatasetBuilder(bin_path, dtype=dtype)
    sources, total_docs, total_tokens = [], 0, 0
    try:
        for path, docs in documents:
            n_docs, n_tokens = 0, 0
            for doc in docs:
                builder.add_item(torch.from_numpy(doc))
                builder.end_document()
                n_docs, n_tokens = n_docs + 1, n_tokens + len(doc)
            sources.append({"path": str(path), "documents": n_docs, "tokens": n_tokens})
            total_docs, total_tokens = total_docs + n_docs, total_tokens + n_tokens
    finally:
        builder.data_file.close()
    builder.finalize(idx_path)
    return {"num_documents": total_docs, "num_tokens": total_tokens, "sources": sources}


def open_token_source(path: str | Path, tokenizer: Optional[Tokenizer] = None):
    """A pretraining token stream: a megamoe token directory, or a Megatron indexed dataset's prefix."""
    from megamoe.data.tokfile import HEADER, TokenFile

    p = Path(path)
    if p.is_dir() or (p / HEADER).exists():
        source = TokenFile(p)
    elif is_indexed_prefix(p) or Path(f"{p}{IDX}").exists() or Path(f"{p}{BIN}").exists():
        source = IndexedTokens(p, tokenizer)
    else:
        hint = " (raw text? tokenise it first with megamoe-prepare-data)" if p.is_file() else ""
        raise DataError(f"{p}: neither a token directory nor a Megatron indexed dataset prefix "
                        f"({p}{BIN} + {p}{IDX}){hint}")
    source.check_tokenizer(tokenizer)
    return source

