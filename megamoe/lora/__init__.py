"""LoRA for hybrid MoE models: adapters on every linear role and the routed experts, sharded
like their base weights at any TP/EP/ETP layout, merge/unmerge, adapter-only checkpoints and
export to HF PEFT (``megamoe.convert.export_peft``; docs/lora.md).

    from megamoe.lora import LoRAConfig, apply_lora, merge, unmerge
    from megamoe.convert import export_peft

``LoRAConfig`` is light (the recipe imports it); the rest loads on first use, since it needs
the model's layers.
"""
from megamoe.lora.config import LoRAConfig

_LAZY = {
    "apply_lora": "megamoe.lora.api", "merge": "megamoe.lora.api", "unmerge": "megamoe.lora.api",
    "check_targets": "megamoe.lora.api", "lora_parameters": "megamoe.lora.api",
    "adapter_state_dict": "megamoe.lora.api", "load_adapter_state_dict": "megamoe.lora.api",
    "trainable_count": "megamoe.lora.api", "is_adapter_name": "megamoe.lora.adapters",
}
# PEFT export is a conversion (it names tensors by the family's table): megamoe.convert
MOVED = {"export_peft": "megamoe.convert.export_peft", "export_peft_checkpoint": "megamoe.convert.export_peft_checkpoint"}

__all__ = ["LoRAConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in MOVED:
        raise AttributeError(f"megamoe.lora.{name} moved to {MOVED[name]}")
    raise AttributeError(f"module 'megamoe.lora' has no attribute {name!r}")
