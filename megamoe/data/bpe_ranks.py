"""tiktoken's BPE rank files (``tiktoken.model``: one ``base64(token) rank`` line per token) read
with bounded size and one-line errors, and the pre-tokenisation pattern of Kimi's tokenizer.

megamoe parses the file itself: ``tiktoken.load.load_tiktoken_bpe`` caches a copy keyed by the
path in a shared temporary folder, so a changed file at the same path could read stale ranks.
"""
from __future__ import annotations

from pathlib import Path

from megamoe.core.errors import DataError

# Kimi's pre-tokenisation (tokenization_kimi.py, which ships as remote code and is not run): Han
# runs, cased words with English contractions (letters outside Han), digits in threes,
# punctuation runs, newlines, spaces
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
MAX_RANKS_BYTES = 256 << 20  # a BPE rank file (Kimi's: 2.8 MB); checked before it is read
MAX_CONFIG_BYTES = 16 << 20


def bounded_file(path: Path, limit: int) -> Path:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.stat().st_size > limit:
        raise DataError(f"{path}: {path.stat().st_size} bytes, more than the {limit}-byte limit for this file")
    return path


def read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model``: ``base64(token) rank`` per line -> {token bytes: rank}; ranks must be
    0..n-1 with every token once (what tiktoken assumes)."""
    import base64
    import binascii

    ranks: dict[bytes, int] = {}
    with open(bounded_file(path, MAX_RANKS_BYTES), "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise DataError(f"{path}:{lineno}: expected 'base64-token rank'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once ({len(ranks)} tokens)")
    return ranks
