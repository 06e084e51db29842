"""Per-layer precision report: where along the stack a lower precision (or a converted model)
departs from the fp32 run.

``capture(model, ids)`` runs one forward with hooks on every decoder layer (its output, the
residual stream) and every MoE router (its top-k expert ids). ``compare(reference, candidate)``
gives one ``LayerRow`` per layer: relative error ``|c - r| / |r|`` and cosine similarity of the
hidden states, and for MoE layers the routing agreement (fraction of tokens whose top-k expert
set is the same). ``first_past(rows, tol)`` names the first layer whose relative error exceeds
``tol``; ``plot(...)`` writes the error by layer as a PNG (Pillow, log scale).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Capture:
    hidden: list[torch.Tensor]  # per layer: its output [b, s, (n,) h] in fp32
    routes: dict[int, torch.Tensor]  # layer index -> [T, k] expert ids (sorted per token)


@dataclass
class LayerRow:
    index: int
    mixer: str
    mlp: str
    rel_err: float
    cosine: float
    routing: float | None  # fraction of tokens with the same top-k set; None without experts


@torch.no_grad()
def capture(model, ids: torch.Tensor) -> Capture:
    """One forward of ``ids`` [b, s] with every layer's output and every router's choice kept."""
    hidden: dict[int, torch.Tensor] = {}
    routes: dict[int, torch.Tensor] = {}
    hooks = []
    for name, layer in model.layers.items():
        i = int(name)
        hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: hidden.__setitem__(i, out.float())))
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            hooks.append(router.register_forward_hook(
                lambda m, a, out, i=i: routes.__setitem__(i, out.idx.sort(dim=-1).values)))
    try:
        model.eval()
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return Capture([hidden[i] for i in sorted(hidden)], routes)


def cast(model, dtype: torch.dtype):
    """A copy of ``model`` with its floating-point parameters and buffers in ``dtype``."""
    return copy.deepcopy(model).to(dtype)


def compare(reference: Capture, candidate: Capture, layout) -> list[LayerRow]:
    """One row per layer (``layout``: the model's parsed layout, for the mixer and MLP letters)."""
    return [layer_row(i, layout.layers[i], r, c, reference.routes.get(i), candidate.routes.get(i))
            for i, (r, c) in enumerate(zip(reference.hidden, candidate.hidden))]


def agreement(r: torch.Tensor | None, c: torch.Tensor | None) -> float | None:
    """Fraction of tokens whose sorted top-k expert ids [T, k] are the same (None without both)."""
    if r is None or c is None:
        return None
    return (r == c).all(dim=-1).float().mean().item()


def layer_row(i: int, kind, reference: torch.Tensor, candidate: torch.Tensor, reference_routes=None,
              candidate_routes=None) -> LayerRow:
    """Layer ``i`` (``kind``: its ``LayerKind``): relative error and cosine of ``candidate``
    against ``reference`` (any equal shapes, compared in fp64), the routing agreement."""
    r, c = reference.double().flatten(), candidate.double().flatten()
    rel = ((c - r).norm() / r.norm().clamp(min=1e-30)).item()
    cos = torch.nn.functional.cosine_similarity(r, c, dim=0).item()
    return LayerRow(i, kind.mixer, kind.mlp, rel, cos, agreement(reference_routes, candidate_routes))


def first_past(rows: list[LayerRow], tol: float) -> LayerRow | None:
    return next((row for row in rows if not row.rel_err <= tol), None)  # NaN counts as past


def table(name: str, rows: list[LayerRow], tol: float) -> str:
    """The printed report of one comparison."""
    lines = [f"{name}: layer  mixer  mlp  rel_err    cosine     routing"]
    for row in rows:
        routing = "-" if row.routing is None else f"{row.routing:.3f}"
        flag = "  <- past tolerance" if not row.rel_err <= tol else ""
        lines.append(f"{name}: {row.index:5d}  {row.mixer:5s}  {row.mlp:3s}  {row.rel_err:.3e}  "
                     f"{row.cosine:.6f}  {routing}{flag}")
    past = first_past(rows, tol)
    lines.append(f"{name}: first layer past tolerance {tol:.0e}: "
                 + ("none" if past is None else f"{past.index} ({past.mixer}{past.mlp})"))
    return "\n".join(lines)


COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]


def plot(series: dict[str, list[LayerRow]], tol: float, path: str | Path, size=(640, 400)) -> Path:
    """A PNG of log10(relative error) by layer, one line per comparison, the tolerance dashed."""
    from PIL import Image, ImageDraw

    w, h = size
    left, right, top, bottom = 60, 20, 20, 40
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    values = [math.log10(max(r.rel_err, 1e-12)) for rows in series.values() for r in rows if r.rel_err == r.rel_err]
    lo = math.floor(min(values + [math.log10(tol)])) if values else -8
    hi = math.ceil(max(values + [math.log10(tol)])) if values else 0
    hi = hi if hi > lo else lo + 1
    n = max((len(rows) for rows in series.values()), default=1)
    x_of = lambda i: left + (w - left - right) * (i / max(n - 1, 1))  # noqa: E731
    y_of = lambda v: top + (h - top - bottom) * (hi - v) / (hi - lo)  # noqa: E731
    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for e in range(lo, hi + 1):
        d.text((5, y_of(e) - 6), f"1e{e}", fill="black")
    for i in range(n):
        d.text((x_of(i) - 4, h - bottom + 5), str(i), fill="black")
    d.text((w // 2 - 60, h - 18), "layer  (relative error, log)", fill="black")
    y_tol = y_of(math.log10(tol))
    for x in range(left, w - right, 8):
        d.line([x, y_tol, x + 4, y_tol], fill=(128, 128, 128))
    for k, (name, rows) in enumerate(series.items()):
        colour = COLOURS[k % len(COLOURS)]
        pts = [(x_of(r.index), y_of(math.log10(max(r.rel_err, 1e-12)))) for r in rows if r.rel_err == r.rel_err]
        if len(pts) > 1:
            d.line(pts, fill=colour, width=2)
        for x, y in pts:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        d.text((left + 10, top + 5 + 14 * k), name, fill=colour)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    img.save(tmp, format="PNG")
    tmp.replace(path)  # never a half-written plot
    return path
