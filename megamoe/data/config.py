"""``DataConfig``: the ``data`` section of a training recipe.

No ``from __future__ import annotations``: OmegaConf reads these annotations at run time.
"""
from dataclasses import dataclass, field
from typing import List, Optional

from megamoe.core.config import check, check_choice, check_positive
from megamoe.data.blend import parse_blend

KINDS = ("pretrain", "sft", "image_caption", "synthetic")
TRUNCATION = ("right", "error")


@dataclass
class DataConfig:
    """What to train on and how samples are cut. See docs/data.md."""

    kind: str = "pretrain"  # pretrain | sft | image_caption | synthetic (no files; see data/synthetic.py)
    # pretrain: token directories (megamoe-prepare-data) or Megatron indexed datasets (the prefix of
    # PREFIX.bin + PREFIX.idx); sft, image_caption: JSONL files. Weighted blend, Megatron's form:
    # [0.3, path_a, 0.7, path_b] (see megamoe/data/blend.py)
    paths: List[str] = field(default_factory=list)
    tokenizer: str = "byte"  # "byte", a SentencePiece .model, a tokenizer.json, or a tokenizer directory
    seq_len: int = 512  # tokens per sample (input_ids and labels are both [b, seq_len])
    seed: int = 1234  # sample order; each epoch is reshuffled from it
    shuffle: bool = True
    num_workers: int = 0  # DataLoader worker processes per rank
    chat_template: Optional[str] = None  # sft: None = the tokenizer's, else built-in; "builtin"; or a .jinja path
    truncation: str = "right"  # sft, image_caption: records longer than seq_len are cut (right) or rejected (error)
    pack: bool = False  # sft: several whole conversations per sample, kept apart as documents
    # sft: special-token strings typed in user and tool messages are encoded as text (HF's
    # split_special_tokens), so user text cannot fake a turn; false: they become control tokens
    split_special_tokens: bool = True
    # pretrain: a new document starts after every EOS of a window (positions restart at 0, no mixer
    # looks across); Megatron's --reset-position-ids --reset-attention-mask
    reset_at_eos: bool = False
    eos_mask_loss: bool = False  # pretrain: no loss where the input token is EOS (Megatron's --eod-mask-loss)
    image_token: str = "<image>"  # image_caption: the placeholder token (must exist in the tokenizer)
    image_tokens: int = 1  # image_caption: placeholders per image (the trainer may pass a callable instead)
    image_root: Optional[str] = None  # image_caption: the folder images must lie in (None: each JSONL's folder)
    generator: Optional[str] = None  # image_caption: "module:function" returning (image, caption) pairs
    generator_samples: int = 0  # image_caption: number of pairs to ask the generator for

    def validate(self, path: str = "data") -> None:
        check_choice(f"{path}.kind", self.kind, KINDS)
        check_positive(f"{path}.seq_len", self.seq_len)
        check(isinstance(self.seed, int) and self.seed >= 0, f"{path}.seed", self.seed, "must be an integer >= 0")
        check(isinstance(self.num_workers, int) and self.num_workers >= 0, f"{path}.num_workers",
              self.num_workers, "must be an integer >= 0")
        check_choice(f"{path}.truncation", self.truncation, TRUNCATION)
        check(isinstance(self.tokenizer, str) and bool(self.tokenizer), f"{path}.tokenizer", self.tokenizer,
              "must be 'byte', a .model file, a tokenizer.json file or a tokenizer directory")
        check(all(isinstance(p, str) and p for p in self.paths), f"{path}.paths", self.paths,
              "must be a list of non-empty path strings")
        _, weights = parse_blend(self.paths, f"{path}.paths")
        check(weights is None or self.generator is None, f"{path}.paths", self.paths,
              "weights blend files; data.generator reads none")
        if self.generator is None:
            check(len(self.paths) > 0 or self.kind == "synthetic", f"{path}.paths", self.paths,
                  "must name at least one file or directory" + (" (or set data.generator)"
                                                                 if self.kind == "image_caption" else ""))
        else:
            check(self.kind == "image_caption", f"{path}.generator", self.generator,
                  "only for kind=image_caption")
            check(":" in self.generator, f"{path}.generator", self.generator, "must be 'module:function'")
            check_positive(f"{path}.generator_samples", self.generator_samples)
        check(not self.pack or self.kind == "sft", f"{path}.pack", self.pack, "only for kind=sft" + (
            f" (pretraining windows: {path}.reset_at_eos=true keeps their documents apart)"
            if self.kind == "pretrain" else ""))
        check(isinstance(self.split_special_tokens, bool), f"{path}.split_special_tokens", self.split_special_tokens,
              "must be true or false")
        for name in ("reset_at_eos", "eos_mask_loss"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"{path}.{name}", value, "must be true or false")
            check(not value or self.kind == "pretrain", f"{path}.{name}", value, "only for kind=pretrain" + (
                f" (sft: {path}.pack=true packs conversations as documents)" if self.kind == "sft" else ""))
        if self.kind == "image_caption":
            check_positive(f"{path}.image_tokens", self.image_tokens)
            check(self.image_tokens < self.seq_len, f"{path}.image_tokens", self.image_tokens,
                  f"must be smaller than seq_len={self.seq_len} to leave room for the caption")
