"""Position encodings shared by the native ViT towers (Kimi-K2.5, GLM-5, and any tower like them).

``resample_grid``: a learned 2D position table ``[Gh, Gw, d]`` resampled to an image's patch grid
``(h, w)`` with ``F.interpolate`` (bicubic or bilinear, with or without ``align_corners``) and
flattened row-major to ``[h*w, d]``; the table itself when the grid already matches (so the
native resolution is bit-exact). Computed in float32 at least (CPU bicubic has no half kernels).

``axial_rope``: 2D rotary angles for a ``(h, w)`` patch grid in the concatenated ``[sin | cos]``
form timm's ``apply_rot_embed_cat`` takes (``half=True``: rotate-half pairs ``(i, i + D/2)``)::

    rope [h*w, 2*D]   D = head_dim,  q = D/4 frequencies  inv[i] = theta^(-4i/D)

Each rotate-half pair ``j < D/2`` turns by ``pos * inv[...]`` where ``layout`` says which axis:

- ``"hw"`` (Qwen-VL, GLM-5; timm's ``RotaryEmbeddingCat``): pairs ``0..q-1`` read the row ``h``,
  pairs ``q..2q-1`` the column ``w``, frequency ``inv[j mod q]``.
- ``"wh_interleaved"`` (Kimi-K2.5's MoonViT): pair ``2i`` reads ``w``, pair ``2i+1`` reads ``h``,
  both at ``inv[i]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

RESAMPLE_MODES = ("bicubic", "bilinear")
ROPE_LAYOUTS = ("hw", "wh_interleaved")


def resample_grid(table: torch.Tensor, size: tuple[int, int], mode: str = "bicubic",
                  align_corners: bool = False) -> torch.Tensor:
    """table [Gh, Gw, d] -> [h*w, d] for a patch grid ``size = (h, w)`` (row-major)."""
    gh, gw, d = table.shape
    h, w = size
    if (h, w) == (gh, gw):
        return table.reshape(h * w, d)
    if mode not in RESAMPLE_MODES:
        raise ValueError(f"resample mode {mode!r} is invalid: allowed: {', '.join(RESAMPLE_MODES)}")
    calc = table.dtype if table.dtype == torch.float64 else torch.float32
    x = table.to(calc).permute(2, 0, 1).unsqueeze(0)  # [1, d, Gh, Gw]
    x = F.interpolate(x, size=(h, w), mode=mode, align_corners=align_corners)
    return x[0].permute(1, 2, 0).reshape(h * w, d).to(table.dtype)


def axial_rope(size: tuple[int, int], head_dim: int, theta: float = 10000.0, layout: str = "hw",
               device=None) -> torch.Tensor:
    """[h*w, 2*head_dim] float32 ``[sin | cos]`` angles of a (h, w) patch grid (see the module doc)."""
    if head_dim % 4:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 4 for 2D rotary embeddings")
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"rope layout {layout!r} is invalid: allowed: {', '.join(ROPE_LAYOUTS)}")
    h, w = size
    q = head_dim // 4
    inv = 1.0 / theta ** (torch.arange(q, dtype=torch.float32, device=device) * 4 / head_dim)   # [q]
    rows = torch.arange(h, dtype=torch.float32, device=device).repeat_interleave(w)           # [n]
    cols = torch.arange(w, dtype=torch.float32, device=device).repeat(h)                      # [n]
    fh, fw = rows[:, None] * inv, cols[:, None] * inv                                          # [n, q]
    if layout == "hw":
        half = torch.cat([fh, fw], dim=-1)
    else:
        half = torch.stack([fw, fh], dim=-1).flatten(1)
    angles = torch.cat([half, half], dim=-1)                                                   # [n, D]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)
