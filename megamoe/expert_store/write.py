"""Write a model's weights as a converted megamoe checkpoint: what the expert store reads.

``megamoe-convert import-hf`` writes the same format from an HF directory; this writes it from
a model in memory (one process, resident experts), e.g. a model trained with megamoe that is
then fine-tuned or served with tiered experts. Atomic: a temporary folder renamed when done.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from megamoe.core.config import ModelConfig
from megamoe.checkpoint.converted import write_checkpoint
from megamoe.core.files import AtomicDir
from megamoe.parallel.groups import ParallelGroups
from megamoe.checkpoint.pieces import GROUPS
from megamoe.parallel.sharding import gather_full, sharding
from megamoe.core.config_io import config_to_dict
from megamoe.checkpoint.dcp import model_tensors


def save_converted(model: nn.Module, config: ModelConfig, out_dir: str | Path, *, overwrite: bool = False,
                   shard_bytes: int = 2 << 30) -> Path:
    """``model`` (built from ``config`` in one process) -> ``out_dir`` (loadable by
    ``checkpoint.load`` and readable as an expert store)."""
    groups = ParallelGroups()
    tensors = model_tensors([model])
    planned = [(name, t.dtype, tuple(t.shape), sharding(t)) for name, t in tensors.items()]
    meta = {"step": 0, "model": config_to_dict(config), "trainer_state": {}}
    sizes = {g: 1 for g in GROUPS}
    stages = [list(range(len(config.parsed_layout().layers)))]
    with AtomicDir(out_dir, overwrite) as tmp:
        write_checkpoint(tmp, meta, planned, lambda name: gather_full(tensors[name], groups), sizes, stages,
                         shard_bytes)
    return Path(out_dir)
