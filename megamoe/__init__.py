"""megamoe: compose, train, LoRA-tune and convert hybrid-attention sparse MoE multimodal models.

The core (config, layout, spec, parallel) does not import ``megamoe.layers`` or
``megamoe.vision``; ``megamoe.model`` is where they meet.
"""
__version__ = "0.1.0"
