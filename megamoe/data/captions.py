"""Image-caption pairs for multimodal training.

Sources:
- JSONL files, one ``{"image": "path", "caption": "..."}`` per line; relative image paths are
  relative to the JSONL file, and every image must lie in its folder (or ``image_root``).
  Records and image files are checked when the dataset is built, images are opened per item
  within ``bounds`` (``megamoe.core.images``: size, mode and frames from the header, before
  decoding, as preprocessing checks them); every problem is a ``FILE:LINE`` error.
- In-memory or generated pairs (``from_pairs``), e.g. the procedurally drawn shapes of
  ``megamoe.data.shapes`` when it is installed (see ``build_dataset``).

Sample: ``input_ids = [image_token] * n + encode(caption) + [EOS]`` padded to ``seq_len``;
``labels`` are the caption and EOS targets (-100 elsewhere: no loss on predicting placeholders);
``image`` is the decoded RGB ``PIL.Image``. ``n`` is ``image_tokens``: an int, or a callable
``image -> int`` (the vision preprocessing knows how many features an image of that size gives).
The trainer turns ``batch["images"]`` into pixel tensors and the model replaces the placeholder
positions, in order, with the projected image features.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from torch.utils.data import Dataset

from megamoe.data.records import data_error, iter_jsonl, require_text
from megamoe.data.samples import Truncations, make_sample
from megamoe.data.tokenizer import Tokenizer
from megamoe.core.config import ImageBoundsConfig
from megamoe.core.errors import DataError
from megamoe.core.images import ImageError, open_image

ImageTokens = Union[int, Callable[[Any], int]]


@dataclass
class CaptionRecord:
    image: Any  # a Path, or an in-memory PIL.Image
    caption: str
    source: str  # file (or generator name) for messages
    line: int  # line in the file (or index of the pair)


def read_caption_records(path: Path, image_root: Optional[str | Path] = None) -> list[CaptionRecord]:
    """All records of one JSONL file; missing fields, missing image files and images outside
    ``image_root`` (default: the JSONL file's folder; symbolic links resolved) are errors here."""
    path = Path(path)
    root = Path(image_root if image_root is not None else path.parent).resolve()
    records = []
    for line, record in iter_jsonl(path):
        image = require_text(record, "image", path, line)
        caption = require_text(record, "caption", path, line)
        image_path = Path(image) if Path(image).is_absolute() else path.parent / image
        if not image_path.resolve().is_relative_to(root):
            raise data_error(path, line, f"field 'image' {image!r} is outside the data folder {root} "
                                         "(set data.image_root to the folder the images are in)")
        if not image_path.is_file():
            raise data_error(path, line, f"image {image!r} not found (looked at {image_path})")
        records.append(CaptionRecord(image_path, caption, str(path), line))
    if not records:
        raise data_error(path, None, "contains no records")
    return records


def load_image(record: CaptionRecord, bounds: Optional[ImageBoundsConfig] = None,
               bounds_path: str = "model.vision.bounds"):
    """The record's image as an RGB ``PIL.Image``, checked against ``bounds`` (default
    ``ImageBoundsConfig()``) from its header before decoding, as preprocessing checks it; an
    undecodable or out-of-bounds image is a FILE:LINE error."""
    name = str(record.image) if isinstance(record.image, Path) else "(a generated image)"
    try:
        return open_image(record.image, bounds or ImageBoundsConfig(), name, bounds_path)
    except ImageError as e:
        raise data_error(record.source, record.line, str(e)) from None


class ImageCaptionDataset(Dataset):
    """``item -> {"input_ids": LongTensor[s], "labels": LongTensor[s], "image": PIL.Image}``."""

    def __init__(self, records: Sequence[CaptionRecord], tokenizer: Tokenizer, seq_len: int,
                 image_token: str = "<image>", image_tokens: ImageTokens = 1, truncation: str = "right",
                 bounds: Optional[ImageBoundsConfig] = None):
        self.records, self.tokenizer, self.seq_len, self.truncation = list(records), tokenizer, seq_len, truncation
        self.bounds = bounds or ImageBoundsConfig()
        token_id = tokenizer.token_to_id(image_token)
        if token_id is None:
            raise DataError(f"tokenizer {tokenizer.name} has no token {image_token!r} "
                            "(set data.image_token to one of its special tokens)")
        self.image_token_id, self.image_tokens = token_id, image_tokens
        self.truncated = Truncations()

    @classmethod
    def from_jsonl(cls, paths: Sequence[str | Path], tokenizer: Tokenizer, seq_len: int,
                   image_root: Optional[str] = None, **kwargs):
        records = [r for p in paths for r in read_caption_records(Path(p), image_root)]
        return cls(records, tokenizer, seq_len, **kwargs)

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[Any, str]], tokenizer: Tokenizer, seq_len: int,
                   name: str = "pairs", **kwargs):
        """Pairs of (PIL image or image path, caption), e.g. from a generator."""
        records = []
        for i, (image, caption) in enumerate(pairs):
            if not isinstance(caption, str) or not caption.strip():
                raise data_error(name, i, f"caption must be a non-empty string, got {caption!r:.60}")
            records.append(CaptionRecord(Path(image) if isinstance(image, (str, Path)) else image, caption, name, i))
        if not records:
            raise data_error(name, None, "gave no pairs")
        return cls(records, tokenizer, seq_len, **kwargs)

    def __len__(self) -> int:
        return len(self.records)

    def num_image_tokens(self, image) -> int:
        n = self.image_tokens(image) if callable(self.image_tokens) else self.image_tokens
        if not isinstance(n, int) or n <= 0:
            raise DataError(f"image_tokens gave {n!r} for an image; must be a positive integer")
        return n

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        image = load_image(record, self.bounds)
        n = self.num_image_tokens(image)
        if n >= self.seq_len:  # cutting placeholders would break the image-feature merge
            raise data_error(record.source, record.line, f"image needs {n} placeholder tokens, "
                                                         f"no room for a caption in seq_len={self.seq_len}")
        # a caption that types "<image>" or "</s>" is text: placeholders and EOS come from here only
        caption = self.tokenizer.encode_text(record.caption) + [self.tokenizer.eos_id]
        ids = [self.image_token_id] * n + caption
        trainable = [False] * n + [True] * len(caption)
        sample = make_sample(ids, trainable, self.seq_len, self.tokenizer.pad_id, self.truncation,
                             (record.source, record.line), self.truncated)
        sample["image"] = image
        return sample
