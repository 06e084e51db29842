"""The expert-load figure: which experts of which layers take the tokens, readable at a glance.

A layers x experts heatmap of each expert's share of its layer's routed tokens, drawn with PIL
(no plotting library needed): labelled axes (layer numbers down the side, expert indices along
the bottom), a colour bar with its scale in percent and the even share (1/E) marked, the
hottest expert of every layer outlined, the three hottest of the figure named under it, and,
when experts are spread over EP ranks, the rank boundaries dashed. With an expert placement
(``model.moe.placement``) the columns are slots and the named experts carry their logical
(HF) index. The PNG records what it shows as text chunks (title, axis labels, colour scale,
hottest experts) for tools and tests.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# a perceptually ordered ramp (dark blue -> teal -> yellow), as viridis
RAMP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)
MARK = (230, 25, 75)  # the outline of each layer's hottest expert


def colours(values: np.ndarray, top: float) -> np.ndarray:
    """[...] values in [0, top] -> [..., 3] uint8 along the ramp."""
    x = np.clip(np.asarray(values, dtype=np.float64) / (top if top > 0 else 1.0), 0, 1) * (len(RAMP) - 1)
    lo = np.floor(x).astype(int).clip(0, len(RAMP) - 2)
    frac = (x - lo)[..., None]
    return (RAMP[lo] * (1 - frac) + RAMP[lo + 1] * frac).astype(np.uint8)


def load_shares(load: dict[int, "np.ndarray"]) -> tuple[list[int], np.ndarray]:
    """{layer: tokens per expert} -> (layer numbers, [layers, experts] share of each layer's tokens)."""
    layers = sorted(load)
    grid = np.stack([np.asarray(load[n], dtype=np.float64) for n in layers])
    return layers, grid / np.maximum(grid.sum(axis=1, keepdims=True), 1e-20)


def hottest(layers: list[int], shares: np.ndarray, order: dict | None, count: int = 3) -> list[dict]:
    """The ``count`` largest shares: layer, slot, logical expert, share."""
    flat = np.argsort(-shares, axis=None, kind="stable")[:count]
    out = []
    for f in flat:
        r, c = divmod(int(f), shares.shape[1])
        logical = (order or {}).get(layers[r], None)
        out.append({"layer": layers[r], "slot": c, "expert": int(logical[c]) if logical else c,
                    "share": round(float(shares[r, c]), 6)})
    return out


def expert_load_figure(load: dict[int, "np.ndarray"], step: int, ep: int = 1, placement: dict | None = None):
    """The figure as (PIL image, PNG text metadata). ``placement``: {layer: slot order} or None."""
    from PIL import Image, ImageDraw, ImageFont

    layers, shares = load_shares(load)
    n_layers, n_experts = shares.shape
    order = {int(k): list(v) for k, v in (placement or {}).items()}
    font = ImageFont.load_default(size=12)
    cw, ch = max(3, min(24, 960 // n_experts)), max(6, min(24, 480 // n_layers))
    left, top, bottom, bar = 60, 40, 96, 90
    width, height = left + cw * n_experts + bar, top + ch * n_layers + bottom
    img = Image.new("RGB", (max(width, 460), height), "white")
    d = ImageDraw.Draw(img)
    vmax = float(shares.max()) if shares.size else 1.0
    cells = np.repeat(np.repeat(colours(shares, vmax), ch, axis=0), cw, axis=1)
    img.paste(Image.fromarray(cells), (left, top))
    title = f"expert load at step {step}: share of each layer's routed tokens"
    d.text((left, 3), title, fill="black", font=font)  # above the colour bar's label, which it may reach over
    xlabel = "expert (slot)" if order else "expert"
    _axes(d, font, layers, n_experts, left, top, cw, ch, ep, xlabel)
    for r in range(n_layers):  # each layer's hottest expert outlined
        c = int(np.argmax(shares[r]))
        d.rectangle([left + c * cw, top + r * ch, left + (c + 1) * cw - 1, top + (r + 1) * ch - 1], outline=MARK, width=2)
    hot = hottest(layers, shares, order)
    lines = ["hottest (each layer's outlined):"] + [
        f"  layer {h['layer']}, expert {h['expert']}" + (f" (slot {h['slot']})" if order else "")
        + f": {100 * h['share']:.1f}% of its tokens" for h in hot]
    for i, line in enumerate(lines):
        d.text((8, top + ch * n_layers + 36 + 14 * i), line, fill="black", font=font)
    _colour_bar(d, font, left + cw * n_experts + 16, top, ch * n_layers, vmax, 1.0 / n_experts)
    meta = {"Title": title, "megamoe:xlabel": xlabel, "megamoe:ylabel": "layer",
            "megamoe:colorbar": f"share of the layer's routed tokens, 0 to {vmax:.6f}",
            "megamoe:even_share": f"{1.0 / n_experts:.6f}", "megamoe:hottest": json.dumps(hot),
            "megamoe:layers": json.dumps(layers), "megamoe:ep_ranks": str(ep)}
    return img, meta


def _axes(d, font, layers, n_experts, left, top, cw, ch, ep, xlabel: str) -> None:
    n_layers = len(layers)
    d.rectangle([left - 1, top - 1, left + cw * n_experts, top + ch * n_layers], outline="black")
    every_row = max(1, -(-14 // ch))  # a label needs ~14 px
    for r in range(0, n_layers, every_row):
        d.text((left - 6, top + r * ch + ch / 2), str(layers[r]), fill="black", font=font, anchor="rm")
    every_col = max(1, -(-28 // cw))
    for c in range(0, n_experts, every_col):
        d.line([left + c * cw + cw / 2, top + ch * n_layers, left + c * cw + cw / 2, top + ch * n_layers + 3], fill="black")
        d.text((left + c * cw + cw / 2, top + ch * n_layers + 4), str(c), fill="black", font=font, anchor="mt")
    d.text((left + cw * n_experts / 2, top + ch * n_layers + 20), xlabel + (" (EP ranks dashed)" if ep > 1 else ""),
           fill="black", font=font, anchor="mt")
    d.text((8, top + ch * n_layers / 2), "layer", fill="black", font=font, anchor="lm")
    if ep > 1 and n_experts % ep == 0:  # EP rank boundaries, dashed
        per = n_experts // ep
        for r in range(1, ep):
            x = left + r * per * cw
            for y in range(top, top + ch * n_layers, 6):
                d.line([x, y, x, min(y + 3, top + ch * n_layers)], fill="white", width=1)


def _colour_bar(d, font, x, top, h, vmax: float, even: float) -> None:
    ramp = colours(np.linspace(vmax, 0, max(h, 2)), vmax)
    for i, rgb in enumerate(ramp):
        d.line([x, top + i, x + 12, top + i], fill=tuple(int(v) for v in rgb))
    d.rectangle([x, top, x + 12, top + h], outline="black")
    at_even = top + h * (1 - even / vmax) if 0 < even <= vmax else None
    for frac in (0.0, 0.5, 1.0):
        y = top + h * (1 - frac)
        if at_even is None or abs(y - at_even) >= 12:  # the even share's label takes its place
            d.text((x + 16, y), f"{100 * vmax * frac:.1f}%", fill="black", font=font, anchor="lm")
    if at_even is not None:
        d.line([x - 3, at_even, x + 15, at_even], fill="black", width=2)
        d.text((x + 16, at_even), f"{100 * even:.1f}% even", fill="black", font=font, anchor="lm")
    d.text((x - 4, top - 22), "share", fill="black", font=font)


def save_png(img, meta: dict, path: str | Path) -> Path:
    """Write the figure with its text chunks, atomically (never a half-written file)."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for k, v in meta.items():
        info.add_text(k, v)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    img.save(tmp, format="PNG", pnginfo=info)
    tmp.replace(path)
    return path
