"""Bounded image preprocessing: open, check, resize and normalise one image for the encoder.

A source (path, bytes, PIL image or uint8 array) becomes a float tensor [3, H, W], normalised
with the encoder's pretrained mean/std (timm's data config). Bounds (``ImageBoundsConfig``):

- rejected with a one-line ``ImageError``: unreadable or truncated files, PIL modes outside
  ``modes``, raw images outside [``min_input_pixels``, ``max_input_pixels``], aspect ratios over
  ``max_aspect_ratio`` and animated images (all from the header, before decoding, by
  ``megamoe.core.images``: training data is checked by the same function), and images whose
  resized size still breaks the pixel bounds (extreme aspect ratios);
- ``dynamic`` resize: both sides multiples of ``patch_multiple``, the pixel count within
  [min_pixels, max_pixels], the aspect ratio kept as closely as possible (the same rounding
  as Qwen2-VL's ``smart_resize``, so token counts match the HF processor);
- ``fixed`` resize: squashed to the encoder's input size.

Image resolution drives memory: an encoder sees H*W / patch^2 patches (see docs/vision.md).
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch

from megamoe.core.config import ImageBoundsConfig
from megamoe.core.errors import ConfigError
from megamoe.core.images import ImageError, check_header, open_image

__all__ = ["ImageError", "ImagePreprocessor", "fit_size"]

RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


def fit_size(height: int, width: int, multiple: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides rounded to ``multiple`` with the pixel count moved into [min_pixels, max_pixels],
    aspect ratio kept (Qwen2-VL's smart_resize rounding)."""
    h = round(height / multiple) * multiple
    w = round(width / multiple) * multiple
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(multiple, math.floor(height / beta / multiple) * multiple)
        w = max(multiple, math.floor(width / beta / multiple) * multiple)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / multiple) * multiple
        w = math.ceil(width * beta / multiple) * multiple
    return h, w


class ImagePreprocessor:
    """source -> normalised float tensor [3, H, W].

    ``mean``/``std``: per-channel normalisation; ``fixed_size``: (H, W) for ``fixed`` resize;
    ``dynamic``: whether the encoder accepts any size (multiple of ``patch_multiple``).
    """

    def __init__(self, bounds: ImageBoundsConfig, *, patch_multiple: int, mean, std,
                 interpolation: str = "bicubic", fixed_size: tuple[int, int] | None = None,
                 dynamic: bool = True, path: str = "model.vision.bounds"):
        bounds.validate(path)
        self.bounds, self.path = bounds, path
        self.multiple = bounds.patch_multiple or patch_multiple
        if self.multiple % patch_multiple:
            raise ConfigError(f"{path}.patch_multiple={self.multiple} is invalid: must be a multiple of "
                              f"{patch_multiple} (encoder patch size x merge size)")
        self.mode = bounds.resize if bounds.resize != "auto" else ("dynamic" if dynamic else "fixed")
        if self.mode == "dynamic" and not dynamic:
            raise ConfigError(f"{path}.resize='dynamic' is invalid: the encoder takes only "
                              f"{fixed_size[0]}x{fixed_size[1]} images (use fixed)")
        if self.mode == "fixed":
            if fixed_size is None or any(s % self.multiple for s in fixed_size):
                raise ConfigError(f"{path}.resize='fixed' is invalid: input size {fixed_size} is not a "
                                  f"multiple of patch_multiple={self.multiple}")
        self.fixed_size = fixed_size
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        self.resample = RESAMPLE.get(str(interpolation), RESAMPLE["bicubic"])

    # ---- checks -------------------------------------------------------------------------

    def open(self, source, name: str | None = None):
        """A decoded RGB PIL image, or a one-line ImageError naming the image (every bound read
        from the header before decoding: ``megamoe.core.images``, the check training data shares)."""
        from PIL import Image

        name = name or (str(source) if isinstance(source, (str, Path)) else "<image>")
        if isinstance(source, (bytes, bytearray)):
            source = io.BytesIO(source)
        elif isinstance(source, np.ndarray):
            if source.dtype != np.uint8 or source.ndim not in (2, 3):
                raise ImageError(f"image {name}: arrays must be uint8 [H, W] or [H, W, C], got "
                                 f"{source.dtype} {list(source.shape)}")
            source = Image.fromarray(source)
        elif not isinstance(source, (str, Path, Image.Image)):
            raise ImageError(f"image {name}: unsupported input type {type(source).__name__} "
                             "(give a path, bytes, a PIL image or a uint8 array)")
        return open_image(source, self.bounds, name, self.path)

    def check(self, img, name: str) -> None:
        """Mode, raw size, aspect-ratio and frame bounds, from the header only."""
        check_header(img, self.bounds, name, self.path)

    def target_size(self, height: int, width: int, name: str = "<image>") -> tuple[int, int]:
        """(H, W) the encoder will see for a raw height x width image."""
        if self.mode == "fixed":
            return self.fixed_size
        b = self.bounds
        h, w = fit_size(height, width, self.multiple, b.min_pixels, b.max_pixels)
        if h < self.multiple or w < self.multiple or h * w > b.max_pixels or h * w < b.min_pixels:
            raise ImageError(f"image {name}: {width}x{height} px cannot be resized into {self.path} "
                             f"[min_pixels={b.min_pixels}, max_pixels={b.max_pixels}] with sides multiple of "
                             f"{self.multiple} (got {w}x{h})")
        return h, w

    # ---- conversion ---------------------------------------------------------------------

    def __call__(self, source, name: str | None = None) -> torch.Tensor:
        """source -> float32 [3, H, W] normalised."""
        name = name or (str(source) if isinstance(source, (str, Path)) else "<image>")
        img = self.open(source, name)
        h, w = self.target_size(img.height, img.width, name)
        if (h, w) != (img.height, img.width):
            img = img.resize((w, h), resample=self.resample)
        x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
        return (x - self.mean) / self.std
