"""megamoe.model (floor 3): model assembly, where the core meets megamoe.layers and megamoe.vision.

    from megamoe.model import build_model, shift_labels, initialize

``language_model`` (LanguageModel and its blocks), ``multimodal`` (the vision tower on the
first stage), ``build`` (``build_model``: whichever of the two a config describes),
``weights`` (layout-independent init, full <-> sharded state dicts), ``params`` (budgets),
``moe_controls`` (what a trainer calls on the MoE layers). The names below load on first use,
so importing a light submodule (``megamoe.model.params``) does not build the layers' registry.
"""
import importlib

_LAZY = {
    "LanguageModel": "megamoe.model.language_model", "build_model": "megamoe.model.build",
    "build_context": "megamoe.model.language_model", "shift_labels": "megamoe.model.language_model",
    "MultimodalModel": "megamoe.model.multimodal", "initialize": "megamoe.model.weights",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megamoe.model' has no attribute {name!r}")
