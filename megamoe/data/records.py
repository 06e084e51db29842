"""Reading raw data files record by record. Every problem is a one-line ``DataError`` that starts
with ``FILE:LINE:``; nothing is skipped silently.

Formats (``.gz`` files are read transparently):
- ``jsonl``: one JSON object per line; blank lines are not records and are ignored. Lines are
  parsed with ``megamoe.core.json_limits`` (at most 64 levels of nesting, no lone surrogates).
- ``paragraphs``: plain text, one document per block of lines separated by blank lines.
- ``lines``: plain text, one document per non-blank line.
``auto`` picks ``jsonl`` for ``.jsonl``/``.json`` files and ``paragraphs`` otherwise.
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megamoe.core.errors import DataError
from megamoe.core.json_limits import JsonLimitError, loads_bounded

FORMATS = ("auto", "jsonl", "paragraphs", "lines")
MAX_LINE_BYTES = 256 << 20  # a book is a few MiB; past this a line is not text data


def data_error(path, line: Optional[int], message: str) -> DataError:
    """``FILE:LINE: message`` on one line (newlines in quoted values are escaped by repr)."""
    where = f"{path}:{line}" if line is not None else f"{path}"
    return DataError(f"{where}: " + " ".join(message.split("\n")))


def short(value: Any, limit: int = 60) -> str:
    """A value for an error message: repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_format(path: Path, fmt: str) -> str:
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is invalid: allowed: {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    suffixes = [s for s in path.suffixes if s != ".gz"]
    return "jsonl" if suffixes and suffixes[-1] in (".jsonl", ".json") else "paragraphs"


def iter_lines(path: Path, on_bytes: Optional[Callable[[int], None]] = None) -> Iterator[tuple[int, str]]:
    """(line number from 1, text without the newline); invalid UTF-8 is an error at its line, and
    so is a line over ``MAX_LINE_BYTES`` (read no further: a file without newlines is not read
    into memory whole).

    ``on_bytes(n)`` is called with the raw size of each line (progress bars)."""
    path = Path(path)
    if not path.is_file():
        raise data_error(path, None, "file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise data_error(path, number, f"line longer than {MAX_LINE_BYTES >> 20} MiB (one record or "
                                               "document per line; is the file newline-separated?)")
            if on_bytes is not None:
                on_bytes(len(raw))
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise data_error(path, number, f"not valid UTF-8 (byte {e.start})") from None
            yield number, text.rstrip("\r\n")


def iter_jsonl(path: Path, on_bytes=None) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for each non-blank line."""
    for number, text in iter_lines(path, on_bytes):
        if not text.strip():
            continue
        try:
            record = loads_bounded(text)
        except JsonLimitError as e:  # not JSON, nested too deep, a lone surrogate
            raise data_error(path, number, str(e)) from None
        if not isinstance(record, dict):
            raise data_error(path, number, f"expected a JSON object, got {type(record).__name__}")
        yield number, record


def require_text(record: dict, key: str, path, line: int, what: str = "") -> str:
    """``record[key]`` as a non-empty string, else a FILE:LINE error naming the field."""
    name = f"{what}{key!r}"
    if key not in record:
        raise data_error(path, line, f"missing field {name} (fields: {', '.join(map(str, record)) or 'none'})")
    value = record[key]
    if not isinstance(value, str):
        raise data_error(path, line, f"field {name} must be a string, got {type(value).__name__} {short(value)}")
    if not value.strip():
        raise data_error(path, line, f"field {name} is empty")
    return value


def iter_documents(path: Path, fmt: str = "auto", text_key: str = "text",
                   on_bytes=None) -> Iterator[tuple[int, str]]:
    """(line where the document starts, text) for every document of a raw text or JSONL file."""
    path = Path(path)
    fmt = resolve_format(path, fmt)
    if fmt == "jsonl":
        for number, record in iter_jsonl(path, on_bytes):
            yield number, require_text(record, text_key, path, number)
    elif fmt == "lines":
        for number, text in iter_lines(path, on_bytes):
            if text.strip():
                yield number, text
    else:
        yield from _paragraphs(iter_lines(path, on_bytes))


def _paragraphs(lines: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    start, block = 0, []
    for number, text in lines:
        if text.strip():
            start = start or number
            block.append(text)
        elif block:
            yield start, "\n".join(block)
            start, block = 0, []
    if block:
        yield start, "\n".join(block)
