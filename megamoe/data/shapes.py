"""Procedurally drawn image-caption pairs: coloured shapes at places, deterministic from a seed.

Every image shows one or two shapes on a light background; the caption names them::

    "a red circle at the top"
    "a blue square on the left and a yellow triangle on the right"

The caption is a function of the image, so a small vision-language model can learn it on a
CPU in a few steps (tests, the quickstart). Used as a ``data.generator``
(``megamoe.data.shapes:shape_pairs``) for ``image_caption`` data, or directly.
Captions only use ``WORDS``, so a word-level vocabulary is ``{w: i for i, w in enumerate(WORDS)}``;
``parse_caption`` reads one back into its (colour, shape, place) fields.
"""
from __future__ import annotations

import numpy as np

COLORS = {"red": (215, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 215), "yellow": (225, 200, 30),
          "purple": (140, 50, 170), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
PLACES = {"at the top": (0.5, 0.25), "at the bottom": (0.5, 0.75), "on the left": (0.25, 0.5),
          "on the right": (0.75, 0.5), "in the middle": (0.5, 0.5)}
WORDS = sorted({w for text in ["a and", *COLORS, *SHAPES, *PLACES] for w in text.split()})


def _draw_shape(draw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)


def draw_sample(rng: np.random.Generator, size: tuple[int, int] = (32, 32)):
    """(PIL RGB image of ``size`` = (height, width), caption) drawn from ``rng``."""
    from PIL import Image, ImageDraw

    h, w = size
    background = tuple(int(v) for v in rng.integers(225, 256, size=3))
    img = Image.new("RGB", (w, h), background)
    draw = ImageDraw.Draw(img)
    two = bool(rng.integers(0, 2))
    places = ["on the left", "on the right"] if two else [list(PLACES)[rng.integers(len(PLACES))]]
    colors = rng.choice(list(COLORS), size=len(places), replace=False)
    parts = []
    for place, color in zip(places, colors):
        shape = SHAPES[rng.integers(len(SHAPES))]
        fx, fy = PLACES[place]
        r = min(h, w) * (0.14 + 0.06 * rng.random())
        _draw_shape(draw, shape, fx * w, fy * h, r, COLORS[color])
        parts.append(f"a {color} {shape} {place}")
    return img, " and ".join(parts)


def shape_pairs(num_samples: int, seed: int = 0, size: int | tuple[int, int] = 32,
                sizes: list | None = None) -> list:
    """``num_samples`` (PIL image, caption) pairs; sample i depends only on (seed, i).

    ``size``: (height, width) or a square side; ``sizes``: optional list of sizes to pick from
    per sample (images of different sizes and aspect ratios).
    """
    out = []
    for i in range(num_samples):
        rng = np.random.default_rng([seed, i])
        choice = sizes[rng.integers(len(sizes))] if sizes else size
        hw = (choice, choice) if isinstance(choice, int) else tuple(choice)
        out.append(draw_sample(rng, hw))
    return out


FIELDS = ("colour", "shape", "place")


def parse_caption(text: str) -> list[tuple]:
    """(colour, shape, place) per "a COLOUR SHAPE PLACE" part of a caption, in order; a field
    that is not one of ``COLORS``/``SHAPES``/``PLACES`` (a wrong or garbled word) is None."""
    out = []
    for part in text.strip().split(" and "):
        words = part.split()[1:] if part.startswith("a ") else part.split()
        colour = words[0] if words and words[0] in COLORS else None
        shape = words[1] if len(words) > 1 and words[1] in SHAPES else None
        place = " ".join(words[2:])
        out.append((colour, shape, place if place in PLACES else None))
    return out
