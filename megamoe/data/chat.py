"""Chat templates and the split of a rendered conversation into prompt and trainable text.

A template is a Jinja string rendered like transformers does (variables ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``; ``raise_exception``), in a sandbox bounded
in time and output (megamoe.data.template_sandbox): templates come from checkpoints. The tokenizer's own
template is used when it has one; otherwise the built-in ChatML template::

    <|im_start|>{role}\\n{content}<|im_end|>\\n      for every message
    <|im_start|>assistant\\n                        generation prompt

Trainable text: for assistant message i, the text that ``render(messages[:i+1])`` adds after
``render(messages[:i], add_generation_prompt=True)``, i.e. the reply and the template's
end-of-turn marker, not the ``<|im_start|>assistant\\n`` header. A template for which these
renders are not prefixes of one another is reported, never guessed around.
"""
from __future__ import annotations

import re
from functools import lru_cache, partial
from pathlib import Path
from typing import Optional

from megamoe.data.tokenizer import Tokenizer
from megamoe.core.errors import DataError

BUILTIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(DataError):
    """Raised by ``raise_exception`` inside a template, or on a non-prefix-stable render."""


def _raise_exception(message):
    raise ChatTemplateError(message)


class ChatTemplate:
    """A Jinja chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = "custom"):
        self.source, self.bos_token, self.eos_token, self.name = source, bos_token, eos_token, name

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The rendered text, in megamoe.data.template_sandbox's bounded sandbox: a template that
        reaches for Python internals, runs too long or writes too much is a one-line error."""
        from megamoe.data.template_sandbox import compile_bounded, render_bounded

        try:
            template = compile_bounded(self.source, (("raise_exception", _raise_exception),))
            return render_bounded(template, dict(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token))
        except ChatTemplateError:
            raise
        except Exception as e:  # syntax, undefined names, recursion, sandbox and limit refusals: one line
            first = (str(e).strip().splitlines() or [""])[0]
            raise ChatTemplateError(f"chat template {self.name}: {type(e).__name__}: {first}") from None

    def segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The rendered conversation as consecutive (text, trainable) pieces; see module docstring."""
        full = self.render(messages)
        pieces: list[tuple[str, bool]] = []
        done = 0  # characters of ``full`` already assigned to pieces
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            turn = self.render(messages[: i + 1])
            if not (turn.startswith(prompt) and full.startswith(turn) and len(prompt) >= done):
                raise ChatTemplateError(f"chat template {self.name} is not prefix-stable at message {i} "
                                    "(rendering a shorter conversation does not give a prefix of the longer one)")
            pieces += [(prompt[done:], False), (turn[len(prompt):], True)]
            done = len(turn)
        pieces.append((full[done:], False))
        return [(text, trainable) for text, trainable in pieces if text]


def resolve_template(spec: Optional[str], tokenizer: Tokenizer) -> ChatTemplate:
    """``None``: the tokenizer's template, else built-in; ``"builtin"``; or a path to a Jinja file."""
    bos, eos = tokenizer.token_string(tokenizer.bos_id), tokenizer.token_string(tokenizer.eos_id)
    if spec is None and tokenizer.chat_template:
        return ChatTemplate(tokenizer.chat_template, bos, eos, name=f"of {tokenizer.name}")
    if spec is None or spec == "builtin":
        return ChatTemplate(BUILTIN_TEMPLATE, bos, eos, name="builtin")
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"chat_template {spec!r}: not 'builtin' nor a Jinja file")
    return ChatTemplate(path.read_text(encoding="utf-8"), bos, eos, name=str(path))


# Private-use characters put around each special-token string typed in a user or tool message
# before rendering (transformers' ``sanitize_control_tokens`` does the same): the template's own
# special tokens are unmarked, so the encoder tells the two apart in the rendered text.
MARK_START, MARK_END = "\ue0f0", "\ue0f1"
TEXT_ROLES = ("user", "tool")


@lru_cache(maxsize=8)
def _special_patterns(specials: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """(any special-token string, longest first; a marked one or a lone marker)."""
    any_special = "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) or "(?!)"
    return re.compile(any_special), re.compile(f"{MARK_START}({any_special}){MARK_END}|[{MARK_START}{MARK_END}]")


def mark_special_tokens(messages: list[dict], specials: tuple[str, ...]) -> list[dict]:
    """The messages with every special-token string in user and tool contents wrapped in markers
    (markers already in any content are dropped first, so none can be forged)."""
    pattern, _ = _special_patterns(specials)
    out = []
    for m in messages:
        content = m["content"].replace(MARK_START, "").replace(MARK_END, "")
        if m["role"] in TEXT_ROLES:
            content = pattern.sub(f"{MARK_START}\\g<0>{MARK_END}", content)
        out.append({**m, "content": content})
    return out


def encode_marked(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of rendered text whose marked special-token strings are plain text
    (``Tokenizer.encode_text``) and the rest, the template's own tokens included, as ``encode``
    gives them. A lone marker (a template that cut a marked string) is dropped, but still
    separates the text on either side."""
    _, marked = _special_patterns(tokenizer.special_tokens())
    pieces = marked.split(text)  # [text, marked token or None, text, ...]
    ids = tokenizer.encode(pieces[0]) if pieces[0] else []
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        if i % 2 == 0:
            ids += tokenizer.encode(piece)
            continue
        as_text = tokenizer.encode_text(piece)
        if tokenizer.token_to_id(piece) in as_text:
            raise DataError(f"special token {piece!r} typed in a user or tool message: tokenizer {tokenizer.name} "
                            "makes it from plain text too, so it cannot be kept as text")
        ids += as_text
    return ids


def tokenize_chat(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict],
                  split_special_tokens: bool = True) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is trainable.

    Each piece is encoded on its own, so a trainable span starts exactly at a token boundary
    (as when the model generates after the prompt at inference). ``split_special_tokens``: a
    special-token string typed in a user or tool message (``<|im_start|>`` ...) is encoded as
    text, so user text cannot fake a turn of the conversation; False makes it a control token."""
    specials = tokenizer.special_tokens() if split_special_tokens else ()
    if specials and any(t in m["content"] for m in messages if m["role"] in TEXT_ROLES for t in specials):
        messages, encode = mark_special_tokens(messages, specials), partial(encode_marked, tokenizer)
    else:
        encode = tokenizer.encode
    ids: list[int] = []
    trainable: list[bool] = []
    for text, flag in template.segments(messages):
        piece = encode(text)
        ids += piece
        trainable += [flag] * len(piece)
    return ids, trainable
