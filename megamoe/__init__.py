"""megamoe: compose, train, LoRA-tune and convert hybrid-attention sparse MoE multimodal models.

The core (config, layout, spec, parallel) does not import ``megamoe.layers`` or
``megamoe.vision``; ``megamoe.model`` is where they meet.
"""
__version__ = "0.1.0"


_MOE_API = ("moe_metrics", "update_expert_bias", "set_aux_loss_scale")


def __getattr__(name):  # lazy, so importing the core does not import megamoe.layers
    if name in _MOE_API:
        from megamoe import moe

        return getattr(moe, name)
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
