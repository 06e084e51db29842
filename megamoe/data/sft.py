"""Supervised fine-tuning on JSONL chat records.

One record per line: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant",
"content": "..."}, ...]}`` with roles ``system``, ``user``, ``assistant``, ``tool``, string
contents, at least one assistant message, and roles in a trainable order (``check_role_order``). All records are checked when the dataset is built
(a malformed one is a ``FILE:LINE`` error); rendering and tokenising happen per item.

Each record is rendered with the chat template (``megamoe.data.chat``); labels are -100
everywhere except the targets that are assistant tokens (reply plus end-of-turn marker), then
the sample is padded/truncated to ``seq_len`` (``megamoe.data.samples``). One conversation per
sample, or with ``data.pack`` (``PackedSFTDataset``) several whole conversations per sample,
each its own document: ``documents`` numbers them, ``positions`` restart at 0 at each one and
no label crosses a boundary, so every mixer keeps them apart (``ForwardInfo.documents``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from torch.utils.data import Dataset

from megamoe.data.chat import ROLES, ChatTemplate, ChatTemplateError, resolve_template, tokenize_chat
from megamoe.data.records import data_error, iter_jsonl, require_text
from megamoe.data.samples import Truncations, make_sample, pack_samples
from megamoe.data.tokenizer import Tokenizer
from megamoe.core.errors import DataError


def check_messages(record: dict, path: Path, line: int) -> list[dict]:
    """The record's messages as [{"role", "content"}], or a FILE:LINE error naming the problem."""
    if "messages" not in record:
        raise data_error(path, line, f"missing field 'messages' (fields: {', '.join(map(str, record)) or 'none'})")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise data_error(path, line, "field 'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise data_error(path, line, f"messages[{i}] must be an object, got {type(m).__name__}")
        extra = sorted(set(map(str, m)) - {"role", "content"})
        if extra:  # (tool_calls, name, ...): dropping them would train on a different conversation
            raise data_error(path, line, f"messages[{i}] has field(s) {', '.join(map(repr, extra))} that megamoe "
                                         "does not render: a message is {role, content}")
        role = require_text(m, "role", path, line, what=f"messages[{i}].")
        if role not in ROLES:
            raise data_error(path, line, f"messages[{i}].role={role!r} is invalid: allowed: {', '.join(ROLES)}")
        out.append({"role": role, "content": require_text(m, "content", path, line, what=f"messages[{i}].")})
    check_role_order(out, path, line)
    if not any(m["role"] == "assistant" for m in out):
        raise data_error(path, line, "no assistant message: nothing to train on")
    return out


def check_role_order(messages: list[dict], path: Path, line: int) -> None:
    """A conversation a chat model can be trained on: a system message only first, then a user
    message opens it, and a tool message answers an assistant's call (follows an assistant or
    another tool message). Templates render any order; a model trained on replies to nothing
    learns to speak unprompted, so these are refused with the message's index."""
    roles = [m["role"] for m in messages]
    for i, role in enumerate(roles):
        before = roles[i - 1] if i else None
        if role == "system" and i:
            raise data_error(path, line, f"messages[{i}].role='system' is invalid: a system message comes first only")
        if before in (None, "system") and role in ("assistant", "tool"):
            raise data_error(path, line, f"messages[{i}].role={role!r} is invalid: a conversation opens with a "
                                         "user message (after an optional system message)")
        if role == "tool" and before not in ("assistant", "tool"):
            raise data_error(path, line, f"messages[{i}].role='tool' is invalid: a tool message follows the "
                                         f"assistant message that called it, not {before!r}")


class SFTDataset(Dataset):
    """``item -> {"input_ids": LongTensor[s], "labels": LongTensor[s]}`` for each chat record."""

    def __init__(self, paths: Sequence[str | Path], tokenizer: Tokenizer, seq_len: int,
                 template: Optional[ChatTemplate] = None, truncation: str = "right", split_special_tokens: bool = True):
        self.tokenizer, self.seq_len, self.truncation = tokenizer, seq_len, truncation
        self.split_special_tokens = split_special_tokens
        self.template = template or resolve_template(None, tokenizer)
        self.records: list[tuple[Path, int, list[dict]]] = []
        for p in map(Path, paths):
            count = len(self.records)
            for line, record in iter_jsonl(p):
                self.records.append((p, line, check_messages(record, p, line)))
            if len(self.records) == count:
                raise data_error(p, None, "contains no records")
        self.truncated = Truncations()
        self.tokenize(0)  # a template that cannot render (or runs past its bounds) is refused before training

    def __len__(self) -> int:
        return len(self.records)

    def tokenize(self, index: int) -> tuple[list[int], list[bool]]:
        """Unpadded token ids of record ``index`` and whether each token is trainable."""
        path, line, messages = self.records[index]
        try:
            return tokenize_chat(self.tokenizer, self.template, messages, self.split_special_tokens)
        except (ChatTemplateError, DataError) as e:
            raise data_error(path, line, str(e)) from None

    def __getitem__(self, index: int) -> dict:
        ids, trainable = self.tokenize(index)
        path, line, _ = self.records[index]
        return make_sample(ids, trainable, self.seq_len, self.tokenizer.pad_id, self.truncation, (path, line),
                           self.truncated)


class PackedSFTDataset(SFTDataset):
    """SFT samples packed several conversations to a sequence: ``item -> {"input_ids", "labels",
    "documents", "positions"}`` (each LongTensor[s]). Conversations are taken in file order and a
    sample is closed when the next one does not fit (first fit in order, so the sample order
    stays deterministic); a conversation longer than ``seq_len`` is alone in its sample and
    truncated by the policy. Padding is one more document of its own (labels -100)."""

    def __init__(self, paths: Sequence[str | Path], tokenizer: Tokenizer, seq_len: int,
                 template: Optional[ChatTemplate] = None, truncation: str = "right", split_special_tokens: bool = True):
        super().__init__(paths, tokenizer, seq_len, template, truncation, split_special_tokens)
        self.bins: list[list[int]] = []
        used = seq_len
        for i in range(len(self.records)):
            n = len(self.tokenize(i)[0])
            if used + n > seq_len:
                self.bins.append([])
                used = 0
            self.bins[-1].append(i)
            used += n

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict:
        parts = []
        for i in self.bins[index]:
            ids, trainable = self.tokenize(i)
            path, line, _ = self.records[i]
            parts.append(make_sample(ids, trainable, min(len(ids), self.seq_len), self.tokenizer.pad_id,
                                     self.truncation, (path, line), self.truncated))
        return pack_samples(parts, self.seq_len, self.tokenizer.pad_id)
