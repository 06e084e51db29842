"""Memory-mapped token files: raw text tokenised once, read by every rank without loading it.

A token file is a directory::

    corpus.tokens/
      tokens.bin    all documents' tokens back to back (uint16 if vocab_size <= 65536, else uint32)
      docs.npy      int64 [num_documents + 1]: document d is tokens[docs[d]:docs[d+1]]
      header.json   format, version, dtype, counts, max_token_id, tokenizer identity (vocab_size), sources

Each document is ``[BOS] + encode(text) + [EOS]`` (BOS only with ``add_bos``). The directory is
written under a temporary name beside the target and renamed when complete, so a crash or a
malformed record leaves no partial output.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from megamoe.data.records import data_error, iter_documents
from megamoe.data.tokenizer import Tokenizer
from megamoe.core.errors import DataError
from megamoe.core.json_limits import JsonLimitError, loads_bounded
from megamoe.core.files import check_replaceable, has_header, replace_dir, temp_dir_beside, written_or_kept
from megamoe.core.interrupt import doing

log = logging.getLogger(__name__)

FORMAT = "megamoe-tokens"
VERSION = 1
HEADER, TOKENS, DOCS = "header.json", "tokens.bin", "docs.npy"
MAX_HEADER_CHARS = 16 << 20  # a header lists its sources; far below this for any real corpus


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def write_token_file(inputs: Sequence[str | Path], output: str | Path, tokenizer: Tokenizer, *,
                     fmt: str = "auto", text_key: str = "text", add_bos: bool = False,
                     overwrite: bool = False, batch_docs: int = 512, progress: bool = True,
                     split_special_tokens: bool = True) -> dict:
    """Tokenise ``inputs`` (text or JSONL files, see ``records``) into the token directory ``output``.

    Returns the header. Raises ``DataError`` (``FILE:LINE: ...``) on the first malformed record,
    leaving neither ``output`` nor a temporary directory behind.
    """
    out = Path(output)
    check_replaceable(out, overwrite, lambda p: has_header(p, HEADER, FORMAT), "token directory", DataError)
    if not inputs:
        raise DataError("no input files given")
    missing = [str(p) for p in inputs if not Path(p).is_file()]
    if missing:  # before any output or progress bar
        raise DataError(f"{missing[0]}: file not found")
    tmp = temp_dir_beside(out)
    try:
        with doing(f"writing {out}", written_or_kept(out)):
            docs = encoded_documents([Path(p) for p in inputs], tokenizer, fmt, text_key, add_bos, batch_docs, progress,
                                     split_special_tokens)
            header = _write(tmp, tokenizer, docs, add_bos)
            replace_dir(tmp, out)
    except BaseException:  # an error or an interruption (SIGTERM, Ctrl-C): no partial output
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s: %d documents, %d tokens (%s)", out, header["num_documents"], header["num_tokens"],
             header["dtype"])
    return header


def _write(tmp: Path, tok: Tokenizer, documents, add_bos: bool) -> dict:
    dtype = token_dtype(tok.vocab_size)
    lengths: list[int] = []
    top = 0
    with open(tmp / TOKENS, "wb") as f:
        sources = []
        for path, docs in documents:
            docs0, tokens0 = len(lengths), sum(lengths)
            for doc in docs:
                f.write(doc.astype(dtype).tobytes())
                lengths.append(len(doc))
                top = max(top, int(doc.max()))
            sources.append({"path": str(path), "documents": len(lengths) - docs0, "tokens": sum(lengths) - tokens0})
        f.flush()
        os.fsync(f.fileno())
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(tmp / DOCS, offsets)
    header = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "num_tokens": int(offsets[-1]),
              "num_documents": len(lengths), "max_token_id": top, "add_bos": bool(add_bos), "append_eos": True,
              "tokenizer": tok.identity(), "sources": sources, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (tmp / HEADER).write_text(json.dumps(header, indent=1) + "\n")
    return header


def encoded_documents(inputs: Sequence[Path], tok: Tokenizer, fmt: str = "auto", text_key: str = "text",
                      add_bos: bool = False, batch_docs: int = 512, progress: bool = True,
                      split_special_tokens: bool = True):
    """``(path, documents)`` per input file, ``documents`` an iterator of int64 arrays
    ``[BOS] + encode(text) + [EOS]`` (what both output formats store). A malformed record, an
    id outside the vocabulary or a file without documents is a ``FILE:LINE`` ``DataError``.
    ``split_special_tokens``: special-token strings in the text (``<|endoftext|>`` in a web page)
    are text, so a document cannot end or split itself; False makes them control tokens."""
    if add_bos and tok.bos_id is None:
        raise DataError(f"tokenizer {tok.name} has no BOS token; add_bos is not possible")
    prefix = [tok.bos_id] if add_bos else []  # (checked before the first output byte)
    with _progress_bar(sum(Path(p).stat().st_size for p in inputs if Path(p).is_file()), progress) as bar:
        for path in inputs:
            yield path, _file_documents(Path(path), tok, prefix, fmt, text_key, batch_docs, bar, split_special_tokens)


def _file_documents(path: Path, tok: Tokenizer, prefix: list, fmt, text_key, batch_docs: int, bar, split: bool):
    count, batch = 0, []
    for line, text in iter_documents(path, fmt, text_key, on_bytes=bar.update):
        batch.append((line, text))
        if len(batch) >= batch_docs:
            count += len(batch)
            yield from _encode(batch, tok, prefix, path, split)
    count += len(batch)
    yield from _encode(batch, tok, prefix, path, split)
    if count == 0:
        raise data_error(path, None, "contains no documents")


def _encode(batch: list, tok: Tokenizer, prefix: list, path: Path, split: bool = True):
    """Encode a batch of (line, text) documents, each ending with EOS."""
    if not batch:
        return
    encoded = (tok.encode_text_batch if split else tok.encode_batch)([text for _, text in batch])
    for (line, _), ids in zip(batch, encoded):
        if not ids:
            raise data_error(path, line, "document encodes to no tokens")
        doc = np.asarray(prefix + list(ids) + [tok.eos_id], dtype=np.int64)
        if doc.max() >= tok.vocab_size or doc.min() < 0:
            raise data_error(path, line, f"token id {int(doc.max())} outside vocab_size={tok.vocab_size}")
        yield doc
    batch.clear()


def _progress_bar(total_bytes: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenising", disable=not enabled)


class TokenFile:
    """A token directory opened read-only: ``tokens`` (memmap), ``doc_offsets``, ``header``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        head = self.path / HEADER
        if not head.is_file():
            hint = " (raw text? tokenise it first with tools/prepare_data.py)" if self.path.is_file() else ""
            raise DataError(f"{self.path}: not a token directory, {HEADER} missing{hint}")
        try:
            self.header = loads_bounded(head.read_text(encoding="utf-8"), max_chars=MAX_HEADER_CHARS)
        except (OSError, UnicodeDecodeError, JsonLimitError) as e:
            raise DataError(f"{head}: unreadable header ({e})") from None
        if not isinstance(self.header, dict) or self.header.get("format") != FORMAT or self.header.get("version") != VERSION:
            raise DataError(f"{head}: not a {FORMAT} v{VERSION} header")
        self._read_header(head)
        size = (self.path / TOKENS).stat().st_size if (self.path / TOKENS).is_file() else -1
        if size != self.num_tokens * self.dtype.itemsize:
            raise DataError(f"{self.path / TOKENS}: {size} bytes, header says {self.num_tokens} tokens "
                            f"of {self.dtype.name}")
        self.tokens = np.memmap(self.path / TOKENS, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        self.doc_offsets = np.load(self.path / DOCS, mmap_mode="r")
        if len(self.doc_offsets) != self.num_documents + 1 or int(self.doc_offsets[-1]) != self.num_tokens:
            raise DataError(f"{self.path / DOCS}: does not match header counts")

    def _read_header(self, head: Path) -> None:
        """dtype, counts and the tokenizer's vocab_size (every id is below it; ``max_token_id``,
        in headers since it was added, says so before a token is read)."""
        h = self.header
        tok = h.get("tokenizer")
        fields = {"dtype": h.get("dtype"), "num_tokens": h.get("num_tokens"), "num_documents": h.get("num_documents"),
                  "tokenizer.vocab_size": tok.get("vocab_size") if isinstance(tok, dict) else None}
        for name, value in fields.items():
            ok = value in ("uint16", "uint32") if name == "dtype" else isinstance(value, int) and value >= 0
            if not ok:
                raise DataError(f"{head}: field {name}={value!r} is invalid")
        self.dtype = np.dtype(h["dtype"])
        self.num_tokens, self.num_documents = h["num_tokens"], h["num_documents"]
        self.vocab_size = tok["vocab_size"]
        top = h.get("max_token_id", 0)
        if not isinstance(top, int) or not 0 <= top < self.vocab_size:
            raise DataError(f"{head}: max_token_id={top!r} is not an id of its tokenizer "
                            f"(vocab_size={self.vocab_size})")

    def document(self, d: int) -> np.ndarray:
        return np.asarray(self.tokens[self.doc_offsets[d]:self.doc_offsets[d + 1]])

    def describe(self) -> str:
        return f"{self.path} ({self.dtype.name})"

    def read(self, begin: int, count: int) -> np.ndarray:
        """Tokens ``[begin, begin + count)`` of the stream (int64); an id at or past the header's
        vocab_size (a damaged or hand-made tokens.bin) is a one-line error, never an embedding's
        IndexError."""
        out = np.asarray(self.tokens[begin:begin + count], dtype=np.int64)
        if out.size and int(out.max()) >= self.vocab_size:
            raise DataError(f"{self.path / TOKENS}: token id {int(out.max())} at tokens [{begin}, {begin + count}) "
                            f"is outside its tokenizer's vocab_size={self.vocab_size}")
        return out

    def doc_start_at_or_after(self, pos: int) -> int:
        """The first document start >= token ``pos`` (``num_tokens`` past the last one)."""
        return int(self.doc_offsets[int(np.searchsorted(self.doc_offsets, pos, side="left"))])

    def eos_id(self, tokenizer: Optional[Tokenizer] = None) -> int:
        """The EOS id that ends every document, from the header (which ``check_tokenizer`` matches
        against the run's tokenizer)."""
        eos = self.header.get("tokenizer", {}).get("eos_id")
        if not isinstance(eos, int) or self.header.get("append_eos") is not True:
            raise DataError(f"{self.path}: header does not say which EOS ends each document (tokenizer.eos_id, "
                            "append_eos); data.reset_at_eos and data.eos_mask_loss need it")
        return eos

    def check_tokenizer(self, tokenizer: Optional[Tokenizer]) -> None:
        """One-line error if this file was written by a different tokenizer."""
        if tokenizer is None:
            return
        mine, theirs = self.header["tokenizer"], tokenizer.identity()
        for key in ("kind", "vocab_size", "eos_id", "sha256"):
            if mine.get(key) != theirs.get(key):
                raise DataError(f"{self.path}: written with tokenizer {mine.get('name')!r} ({key}={mine.get(key)!r}), "
                                f"not {theirs.get('name')!r} ({key}={theirs.get(key)!r})")
