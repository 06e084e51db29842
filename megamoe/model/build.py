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


def stage_cut(config: ModelConfig, stage: tuple[int, int]) -> dict:
    """``build_model``'s keywords for pipeline stage ``stage`` = (index, stages): its layers cut by
    ``Layout.stages(stages, balanced=True)``, the first stage holding the embedding, the last the
    output layer; {} for one stage."""
    index, stages = stage
    if stages == 1:
        return {}
    return dict(layer_ids=config.parsed_layout().stages(stages, balanced=True)[index], pre_process=index == 0,
                post_process=index == stages - 1)
