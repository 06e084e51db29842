"""JSON from files megamoe did not write, parsed with bounds: nesting depth, size, and text that
UTF-8 can hold.

``json.loads`` recurses once per level of nesting, so a line of 200,000 ``[`` ends in a
``RecursionError`` traceback; ``"\\ud800"`` (a lone UTF-16 surrogate, legal JSON) decodes to a
string no encoder accepts and fails later, deep inside a tokenizer. ``loads_bounded`` refuses all
three before the value is used, with a ``JsonLimitError`` (a ``ValueError``) whose one-line
message the caller prefixes with the file (and line) it read::

    try:
        record = loads_bounded(text)
    except JsonLimitError as e:
        raise DataError(f"{path}:{line}: {e}")
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

MAX_DEPTH = 64  # arrays/objects inside one another; real records and configs use under 10
_BRACKETS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')  # a string (skipped whole) or a bracket


class JsonLimitError(ValueError):
    """A JSON text past a bound, or not JSON (the message is one line)."""


def nesting_depth(text: str, stop: int = MAX_DEPTH) -> int:
    """The deepest nesting of arrays and objects in ``text`` (brackets inside strings do not
    count), or ``stop + 1`` as soon as it is passed. Texts with fewer brackets than ``stop`` cost
    two ``str.count`` calls."""
    if text.count("[") + text.count("{") <= stop:
        return 0  # cannot be deeper than stop
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        c = m.group(0)
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def lone_surrogate(value: Any, where: str = "") -> Optional[str]:
    """Where (``messages[2].content``) the first string holding a lone UTF-16 surrogate sits in
    a parsed value, keys included; None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "the value"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            k_text = k.encode("utf-8", "backslashreplace").decode("utf-8")  # printable, surrogate or not
            inner = f"{where}.{k_text}" if where else k_text
            found = lone_surrogate(k, f"{inner} (key)") or lone_surrogate(v, inner)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate(v, f"{where}[{i}]")
            if found:
                return found
    return None


def loads_bounded(text: str, *, max_depth: int = MAX_DEPTH, max_chars: Optional[int] = None) -> Any:
    """``json.loads(text)`` within bounds: at most ``max_chars`` characters (None: no bound) and
    ``max_depth`` levels of nesting, no lone surrogates in strings; else ``JsonLimitError``."""
    if max_chars is not None and len(text) > max_chars:
        raise JsonLimitError(f"{len(text)} characters of JSON, over the {max_chars}-character limit")
    if nesting_depth(text, max_depth) > max_depth:
        raise JsonLimitError(f"JSON nested deeper than {max_depth} levels")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonLimitError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # (a max_depth above the interpreter's own limit)
        raise JsonLimitError("JSON nested deeper than Python can parse") from None
    if "\\u" in text:  # only \uXXXX escapes make a lone surrogate (strict UTF-8 decoding refuses one)
        where = lone_surrogate(value)
        if where:
            raise JsonLimitError(f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff alone is not text)")
    return value
