"""Images from files megamoe did not write, opened within ``ImageBoundsConfig`` before decoding.

The one check that training data (``megamoe.data.captions``) and preprocessing
(``megamoe.vision.preprocess``) share, so an image is refused alike wherever it enters. PIL opens
lazily: ``Image.open`` reads the header (size, mode, frames) and decodes nothing, so every bound is
checked before a pixel is decoded:

- size: ``min_input_pixels <= W*H <= max_input_pixels`` (a 30000x30000 PNG is a one-line error,
  never PIL's ``DecompressionBombError`` traceback nor 3.6 GB decoded) and the aspect ratio;
- mode: only ``modes`` (CMYK, 16-bit ``I;16``, float ``F`` ... are refused, not clipped);
- frames: an animated image (GIF, APNG, WebP) is refused unless ``animated: first_frame`` says
  to use its first frame.

Every refusal is a one-line ``ImageError`` naming the image and the bound.
"""
from __future__ import annotations

import re
import warnings

from megamoe.core.config import ImageBoundsConfig
from megamoe.core.errors import MegamoeError


class ImageError(MegamoeError, ValueError):
    """An image is unreadable, of a wrong mode or outside the configured bounds."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_header(img, bounds: ImageBoundsConfig, name: str, path: str = "model.vision.bounds") -> None:
    """Mode, raw size, aspect ratio and frames of an opened (not yet decoded) PIL image."""
    b = bounds
    w, h = img.size
    if img.mode not in b.modes:
        raise ImageError(f"image {name}: mode {img.mode!r} is not allowed ({path}.modes: "
                         f"{', '.join(b.modes)}); convert it first")
    if w < 1 or h < 1:
        raise ImageError(f"image {name}: empty ({w}x{h} px)")
    if w * h > b.max_input_pixels:
        raise ImageError(f"image {name}: {w}x{h} = {w * h} px is over {path}.max_input_pixels={b.max_input_pixels}")
    if w * h < b.min_input_pixels:
        raise ImageError(f"image {name}: {w}x{h} = {w * h} px is under {path}.min_input_pixels={b.min_input_pixels}")
    ratio = max(w, h) / min(w, h)
    if ratio > b.max_aspect_ratio:
        raise ImageError(f"image {name}: aspect ratio {ratio:.1f} ({w}x{h} px) is over "
                         f"{path}.max_aspect_ratio={b.max_aspect_ratio}")
    if getattr(img, "is_animated", False) and b.animated != "first_frame":
        raise ImageError(f"image {name}: animated (more than one frame); {path}.animated=first_frame uses "
                         "its first frame")


def open_image(source, bounds: ImageBoundsConfig, name: str, path: str = "model.vision.bounds"):
    """A file path, a binary file object or a PIL image -> the decoded RGB ``PIL.Image``, after
    ``check_header``; an unreadable or truncated file is a one-line ``ImageError`` too."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        check_header(source, bounds, name, path)
        return source if source.mode == "RGB" else source.convert("RGB")
    try:
        with warnings.catch_warnings():  # PIL warns past its own limit; the bounds decide, in one line
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(source)
    except Image.DecompressionBombError as e:  # past twice PIL's limit, raised by the lazy open itself
        size = re.search(r"\((\d+) pixels\)", str(e))
        if size is None:
            raise ImageError(f"image {name}: {_first_line(e)}") from None
        limit = (f"{path}.max_input_pixels={bounds.max_input_pixels}" if int(size.group(1)) > bounds.max_input_pixels
                 else "PIL's decompression-bomb limit (2 x PIL.Image.MAX_IMAGE_PIXELS)")
        raise ImageError(f"image {name}: {size.group(1)} px is over {limit}") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageError(f"image {name}: unreadable ({_first_line(e)})") from None
    with img:
        check_header(img, bounds, name, path)
        try:
            img.load()  # decode now: a truncated file fails here, not deep inside the model
            return img.copy() if img.mode == "RGB" else img.convert("RGB")
        except (OSError, ValueError) as e:
            raise ImageError(f"image {name}: unreadable ({_first_line(e)})") from None
