"""Tokenizers behind one small interface: byte-level (built in), SentencePiece, HF tokenizer.json.

Every tokenizer has ``encode(text) -> list[int]`` (no BOS/EOS added; special-token strings in
the text such as ``<|im_end|>`` map to their ids where the tokenizer defines them),
``encode_text(text)`` (the same text with special-token strings kept as text: for what users
type, as HF's ``split_special_tokens``), ``special_tokens()``,
``decode(ids) -> str``, ``token_to_id``, ``bos_id`` (or None), ``eos_id``, ``pad_id`` (the EOS id
when the tokenizer has no pad token), ``vocab_size`` (number of ids, special tokens included),
``chat_template`` (a Jinja string or None) and ``identity()`` (recorded in token files so a
file is never read with a different tokenizer).

``load_tokenizer(spec)``: ``"byte"``, a SentencePiece ``.model`` file, a ``tokenizer.json`` file,
a tiktoken folder (``tiktoken.model`` + ``tokenizer_config.json``, Kimi's format: read by the
``tiktoken`` package, no remote code) or any other tokenizer directory (read by transformers'
``AutoTokenizer`` from local files only). sentencepiece, tokenizers, tiktoken and transformers are
imported only when such a tokenizer is loaded.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Optional, Sequence

from megamoe.data.bpe_ranks import KIMI_PATTERN, MAX_CONFIG_BYTES, bounded_file, read_bpe_ranks
from megamoe.core.errors import DataError

# Strings that name an end-of-sequence token in common tokenizer.json files without a config.
KNOWN_EOS = ("</s>", "<|endoftext|>", "<|im_end|>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")


def optional_import(module: str, pip_name: str, what: str):
    """Import an optional dependency, or a one-line error saying what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the {module!r} package: pip install {pip_name}") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """The interface the data pipeline uses. Subclasses set the attributes in ``__init__``."""

    kind: str = ""
    name: str = ""
    vocab_size: int = 0
    bos_id: Optional[int] = None
    eos_id: int = 0
    pad_id: int = 0
    chat_template: Optional[str] = None
    fingerprint: str = ""  # sha256 of the tokenizer's defining file(s)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> Optional[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def special_tokens(self) -> tuple[str, ...]:
        """The special-token strings ``encode`` turns into control ids when text holds them."""
        return ()

    def encode_text(self, text: str) -> list[int]:
        """``text`` as plain text: special-token strings in it are encoded as the characters they
        are, never as control ids (HF's ``split_special_tokens``). This default, for tokenizers
        without such a switch, encodes each special-token string in two pieces (its first
        character, then the rest, likewise)."""
        specials = sorted(self.special_tokens(), key=len, reverse=True)
        if not any(t in text for t in specials):
            return self.encode(text)
        pattern = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
        ids: list[int] = []
        for i, part in enumerate(pattern.split(text)):
            if i % 2:  # a special-token string
                ids += self.encode(part[0]) + self.encode_text(part[1:])
            elif part:
                ids += self.encode(part)
        return ids

    def encode_text_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_text(t) for t in texts]

    def token_string(self, token_id: Optional[int]) -> str:
        """The text of a special token (for chat templates' ``bos_token``/``eos_token``)."""
        return "" if token_id is None else self.decode([token_id])

    def identity(self) -> dict:
        return {"kind": self.kind, "name": self.name, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id, "sha256": self.fingerprint}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes plus a few special tokens; needs no files (tests, CPU quickstart).

    ids 0..5 are ``<pad> <s> </s> <image> <|im_start|> <|im_end|>``; byte b is id ``b + 6``.
    """

    SPECIALS = ("<pad>", "<s>", "</s>", "<image>", "<|im_start|>", "<|im_end|>")
    OFFSET = len(SPECIALS)

    def __init__(self):
        self.kind = self.name = "byte"
        self.vocab_size = self.OFFSET + 256
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.fingerprint = hashlib.sha256("|".join(self.SPECIALS).encode()).hexdigest()
        self._special_ids = {s: i for i, s in enumerate(self.SPECIALS)}
        self._split = re.compile("(" + "|".join(map(re.escape, self.SPECIALS)) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self._special_ids:
                ids.append(self._special_ids[part])
            elif part:
                ids.extend(b + self.OFFSET for b in part.encode("utf-8"))
        return ids

    def special_tokens(self) -> tuple[str, ...]:
        return self.SPECIALS

    def encode_text(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if self.OFFSET <= i < self.vocab_size:
                pending.append(i - self.OFFSET)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            # an id past the tokenizer (a model's vocab padded beyond it can sample one) is U+FFFD
            out.append(self.SPECIALS[i] if 0 <= i < self.OFFSET else "\ufffd")
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._special_ids.get(token)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file. Special-token strings in text are not parsed (SentencePiece
    treats them as text) unless the model declares them as user-defined symbols."""

    def __init__(self, path: Path):
        spm = optional_import("sentencepiece", "sentencepiece", f"{path}")
        self.kind, self.name = "sentencepiece", str(path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise DataError(f"{path}: not a readable SentencePiece model ({_first_line(e)})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        if self.sp.eos_id() < 0:
            raise DataError(f"{path}: SentencePiece model has no EOS piece (eos_id=-1); it cannot end documents")
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self.fingerprint = file_sha256(path)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def special_tokens(self) -> tuple[str, ...]:
        """User-defined symbols: the pieces SentencePiece matches in text (control pieces it never does)."""
        if not hasattr(self, "_user_defined"):
            try:  # the model's own record of its pieces' types (needs protobuf)
                from sentencepiece import sentencepiece_model_pb2 as pb

                proto = pb.ModelProto()
                proto.ParseFromString(self.sp.serialized_model_proto())
                kinds = [p.type == pb.ModelProto.SentencePiece.USER_DEFINED for p in proto.pieces]
            except ImportError:  # else: <...> pieces that text encodes to themselves
                kinds = [(lambda p: len(p) > 2 and p[0] == "<" and p[-1] == ">" and self.sp.encode(p) == [i])(
                    self.sp.id_to_piece(i)) for i in range(self.vocab_size)]
            self._user_defined = tuple(self.sp.id_to_piece(i) for i, user in enumerate(kinds) if user)
        return self._user_defined

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def token_string(self, token_id: Optional[int]) -> str:
        return "" if token_id is None else self.sp.id_to_piece(token_id)


class TokenizerJson(Tokenizer):
    """A bare HF ``tokenizer.json`` read with the ``tokenizers`` package.

    Special tokens come from a ``tokenizer_config.json`` beside the file if there is one,
    otherwise EOS is the first of ``KNOWN_EOS`` the file defines.
    """

    def __init__(self, path: Path):
        tokenizers = optional_import("tokenizers", "tokenizers", f"{path}")
        self.kind, self.name = "tokenizer.json", str(path)
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust error type is not exported
            raise DataError(f"{path}: not a readable tokenizer.json ({_first_line(e)})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(path.parent / "tokenizer_config.json") if (path.parent / "tokenizer_config.json").is_file() else {}
        self.bos_id = self._special(config.get("bos_token"))
        eos = self._special(config.get("eos_token"))
        if eos is None:
            eos = next((i for i in map(self.tok.token_to_id, KNOWN_EOS) if i is not None), None)
        if eos is None:
            raise DataError(f"{path}: no EOS token found (add eos_token to a tokenizer_config.json beside it)")
        self.eos_id = eos
        pad = self._special(config.get("pad_token"))
        self.pad_id = eos if pad is None else pad
        self.chat_template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
        self.fingerprint = file_sha256(path)

    def _special(self, entry) -> Optional[int]:
        """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
        if isinstance(entry, dict):
            entry = entry.get("content")
        return self.tok.token_to_id(entry) if isinstance(entry, str) else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def special_tokens(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.tok.get_added_tokens_decoder().values() if t.special)

    def encode_text(self, text: str) -> list[int]:
        return self.encode_text_batch([text])[0]

    def encode_text_batch(self, texts: Sequence[str]) -> list[list[int]]:
        self.tok.encode_special_tokens = True  # the tokenizers switch behind HF's split_special_tokens
        try:
            return self.encode_batch(texts)
        finally:
            self.tok.encode_special_tokens = False

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)


class HFTokenizer(Tokenizer):
    """A tokenizer directory loaded by transformers' ``AutoTokenizer`` from local files only
    (any format transformers reads; chat template from the directory)."""

    def __init__(self, path: Path):
        transformers = optional_import("transformers", "'megamoe[hf]'", f"tokenizer directory {path}")
        self.kind, self.name = "hf", str(path)
        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises many types for unreadable directories
            raise DataError(f"{path}: not a tokenizer directory transformers can read ({_first_line(e)})") from None
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        if self.tok.eos_token_id is None:
            raise DataError(f"{path}: tokenizer has no eos_token (set it in tokenizer_config.json)")
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.eos_id if self.tok.pad_token_id is None else self.tok.pad_token_id
        template = getattr(self.tok, "chat_template", None)
        self.chat_template = template if isinstance(template, str) else None
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".model", ".txt", ".jinja"))
        h = hashlib.sha256()
        for p in files:
            h.update(p.name.encode() + file_sha256(p).encode())
        self.fingerprint = h.hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def special_tokens(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.tok.added_tokens_decoder.values() if t.special)

    def encode_text(self, text: str) -> list[int]:
        return self.encode_text_batch([text])[0]

    def encode_text_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not getattr(self.tok, "is_fast", False):
            return [super(HFTokenizer, self).encode_text(t) for t in texts]
        return self.tok(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.tok.convert_tokens_to_ids(token)
        return None if i is None or i == self.tok.unk_token_id and token != self.tok.unk_token else i




class TiktokenTokenizer(Tokenizer):
    """A folder with ``tiktoken.model`` (one ``base64(token) rank`` line per BPE token) and
    ``tokenizer_config.json``, Kimi's format, encoded by the ``tiktoken`` package.

    ids ``0..n-1`` are the ranks, ``n..n+R-1`` the ``num_reserved_special_tokens`` (default 256)
    special tokens, named by ``added_tokens_decoder`` or ``<|reserved_token_{id}|>``; BOS, EOS and
    pad from ``bos_token``/``eos_token``/``pad_token``; the chat template from ``chat_template`` or
    a ``chat_template.jinja`` beside it. The pre-tokenisation regex is the config's ``pat_str``,
    else Kimi's (``KIMI_PATTERN``), which lives in remote code megamoe does not run.
    """

    def __init__(self, path: Path):
        tiktoken = optional_import("tiktoken", "tiktoken", f"tokenizer directory {path}")
        self.kind, self.name = "tiktoken", str(path)
        config = _read_json(bounded_file(path / "tokenizer_config.json", MAX_CONFIG_BYTES))
        ranks = read_bpe_ranks(path / "tiktoken.model")
        n, reserved = len(ranks), config.get("num_reserved_special_tokens", 256)
        named = {int(k): v.get("content") for k, v in (config.get("added_tokens_decoder") or {}).items()
                 if str(k).isdigit() and isinstance(v, dict) and isinstance(v.get("content"), str)}
        self.specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + int(reserved))}
        pattern = config.get("pat_str", KIMI_PATTERN)
        try:
            self.enc = tiktoken.Encoding(name=path.name or "tiktoken", pat_str=pattern, mergeable_ranks=ranks,
                                         special_tokens=self.specials)
        except ValueError as e:
            raise DataError(f"{path}/tokenizer_config.json: pat_str or tiktoken.model rejected by tiktoken "
                            f"({_first_line(e)})") from None
        self.vocab_size = self.enc.n_vocab
        self.bos_id = self._special(config.get("bos_token"))
        self.eos_id = self._special(config.get("eos_token"))
        if self.eos_id is None:
            raise DataError(f"{path}/tokenizer_config.json: eos_token is missing or not a special token")
        pad = self._special(config.get("pad_token"))
        self.pad_id = self.eos_id if pad is None else pad
        template = config.get("chat_template")
        jinja = path / "chat_template.jinja"
        if not isinstance(template, str) and jinja.is_file():
            template = bounded_file(jinja, MAX_CONFIG_BYTES).read_text(encoding="utf-8")
        self.chat_template = template if isinstance(template, str) else None
        h = hashlib.sha256()
        for p in (path / "tiktoken.model", path / "tokenizer_config.json", jinja):
            if p.is_file():
                h.update(p.name.encode() + file_sha256(p).encode())
        self.fingerprint = h.hexdigest()

    def _special(self, entry) -> Optional[int]:
        if isinstance(entry, dict):
            entry = entry.get("content")
        return self.token_to_id(entry) if isinstance(entry, str) else None

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def special_tokens(self) -> tuple[str, ...]:
        return tuple(self.specials)

    def encode_text(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]  # an id past the tokenizer (padded vocab) decodes to U+FFFD
        parts, run = [], []
        for i in ids + [None]:
            if i is not None and 0 <= i < self.vocab_size:
                run.append(i)
                continue
            parts.append(self.enc.decode(run, errors="replace"))
            run = []
            if i is not None:
                parts.append("\ufffd")
        return "".join(parts)

    def token_to_id(self, token: str) -> Optional[int]:
        if token in self.specials:
            return self.specials[token]
        try:
            return self.enc.encode_single_token(token)
        except KeyError:
            return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable JSON file ({_first_line(e)})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object")
    return data


SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789"


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"byte"``, a ``.model`` file, a ``tokenizer.json`` (any ``.json``) file, a tiktoken folder or a
    tokenizer directory.
    A tokenizer that cannot encode text (e.g. an HF model folder without tokenizer files, which
    transformers reads as a one-id vocabulary) is refused: it would train at loss 0."""
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tiktoken.model").is_file():
        return check_usable(TiktokenTokenizer(path))
    if path.is_dir():
        return check_usable(HFTokenizer(path))
    if not path.is_file():
        raise DataError(f"tokenizer {str(spec)!r} not found (use 'byte', a SentencePiece .model file, "
                        "a tokenizer.json file or a tokenizer directory)")
    if path.suffix == ".json":
        return check_usable(TokenizerJson(path))
    return check_usable(SentencePieceTokenizer(path))


def check_usable(tok: Tokenizer) -> Tokenizer:
    """At least two ids (EOS and some text) and a sample sentence encodes to ids other than EOS/UNK."""
    if tok.vocab_size < 2:
        raise DataError(f"tokenizer {tok.name}: has {tok.vocab_size} id(s), fewer than any text needs "
                        f"(a model folder without tokenizer files? point data.tokenizer / --tokenizer at one)")
    ids = tok.encode(SAMPLE_TEXT)
    unknown = {tok.eos_id, tok.token_to_id("<unk>")} - {None}
    if not ids or all(i in unknown for i in ids):
        raise DataError(f"tokenizer {tok.name}: encodes the sample text {SAMPLE_TEXT!r} to "
                        f"{'nothing' if not ids else 'unknown tokens only'} ({tok.vocab_size} ids)")
    return tok
