"""Plan a model without allocating it: build on the meta device, report layout and budget."""
from __future__ import annotations

import torch

from megamoe.config import ModelConfig
from megamoe.params import ParamBudget, count_parameters, format_budget, human


def meta_model(cfg: ModelConfig):
    """The full model on ``torch.device('meta')``: shapes only, no memory, no init.
    With ``cfg.vision`` it is the multimodal model (its tower counts as part ``vision``)."""
    from megamoe.model import LanguageModel

    with torch.device("meta"):
        if cfg.vision is not None:
            from megamoe.multimodal import MultimodalModel

            return MultimodalModel(cfg, device="meta")
        return LanguageModel(cfg, device="meta")


def budget(cfg: ModelConfig) -> ParamBudget:
    return count_parameters(meta_model(cfg))


def describe(cfg: ModelConfig) -> str:
    """Layout, per-layer kinds and the parameter budget, as printed by tools/show_model.py."""
    from megamoe.layout import MIXERS, MLPS

    layout = cfg.validate()
    b = budget(cfg)
    kinds = {f"layers.{i}": str(k) for i, k in enumerate(layout.layers)}
    counts = layout.counts()
    legend = ", ".join(f"{k}={MIXERS[k][0]} x{counts[k]}" for k in MIXERS if k in counts)
    legend += "; " + ", ".join(f"{k}={MLPS[k][0]} x{counts[k]}" for k in MLPS if k in counts)
    stages = f"{len(layout.cuts) + 1} pipeline stage(s)" if layout.cuts else "no pipeline cuts"
    lines = [
        f"layout: {cfg.layout}",
        f"layers: {layout.num_layers} ({stages}): {layout.compact()}",
        f"kinds: {legend}",
        format_budget(b, kinds),
        f"summary: {human(b.total)} total, {human(b.active)} active per token, "
        f"{layout.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
    ]
    return "\n".join(lines)
