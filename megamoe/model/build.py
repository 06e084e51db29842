"""The model a config describes: its ``LanguageModel``, or with a ``vision`` section the
``MultimodalModel`` around it (so the language model does not know the multimodal one)."""
from __future__ import annotations

from megamoe.core.config import ModelConfig
from megamoe.model.language_model import LanguageModel
from megamoe.model.multimodal import MultimodalModel
from megamoe.parallel.groups import ParallelGroups


def build_model(cfg: ModelConfig, groups: ParallelGroups | None = None, *, sequence_parallel: bool = False,
                device=None, **kw) -> LanguageModel:
    """``kw``: a pipeline stage's ``layer_ids``, ``pre_process``, ``post_process``; ``fp8``."""
    cls = MultimodalModel if cfg.vision is not None else LanguageModel
    return cls(cfg, groups, sequence_parallel=sequence_parallel, device=device, **kw)
