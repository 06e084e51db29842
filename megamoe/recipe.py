"""Recipes: YAML files loaded with OmegaConf into the typed configs, plus key=value overrides.

A recipe is the record of a run. Each top-level section maps to one component's dataclass;
the component receives only its own section.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megamoe.core.config import ModelConfig, ParallelConfig, check_pipeline_support, validate_model_parallel
from megamoe.core.config_io import config_from_dict, config_to_dict, one_line, to_yaml  # noqa: F401  (re-exported)
from megamoe.data.blend import parse_blend
from megamoe.data.config import DataConfig
from megamoe.core.errors import ConfigError
from megamoe.core.files import check_apart
from megamoe.lora.config import LoRAConfig
from megamoe.parallel.context import check_cp_length
from megamoe.training.config import CheckpointConfig, EvalConfig, LoggingConfig, OptimConfig, TrainConfig

RECIPE_DIR = Path(__file__).parent / "recipes"


@dataclass
class Recipe:
    """A run: the model and its parallel layout, and (for training) data, schedule, optimizer,
    checkpoints and logging. Each component receives its own section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation during training (docs/training.md)
    lora: Optional[LoRAConfig] = None  # set: fine-tune adapters on the frozen loaded model (docs/lora.md)

    def validate(self) -> None:
        """Every section, and the checks that need several (for a training run)."""
        self.validate_plan()
        for section in (self.data, self.optim, self.checkpoint, self.logging, self.eval):
            section.validate()
        if self.eval.save_best and not self.checkpoint.dir:
            raise ConfigError("eval.save_best=True is invalid: needs checkpoint.dir (the best checkpoint goes to "
                              "<checkpoint.dir>/best)")
        self.check_outputs_apart()

    def check_outputs_apart(self) -> None:
        """checkpoint.dir and logging.dir (what a run writes) are apart from what it reads: data,
        validation data, the tokenizer, a chat template file and checkpoint.load."""
        inputs = [(f"data.paths[{i}]", p) for i, p in enumerate(parse_blend(self.data.paths)[0])]
        inputs += [(f"eval.paths[{i}]", p) for i, p in enumerate(parse_blend(self.eval.paths, "eval.paths")[0])]
        inputs += [(name, value) for name, value in (("data.tokenizer", self.data.tokenizer),
                                                     ("data.chat_template", self.data.chat_template),
                                                     ("checkpoint.load", self.checkpoint.load))
                   if value and value not in ("byte", "builtin")]
        for name in ("checkpoint.dir", "logging.dir"):
            out = getattr(getattr(self, name.split(".")[0]), "dir")
            if out:
                check_apart(out, inputs, ConfigError, label=f"{name}={out}")

    def validate_plan(self, world_size: int | None = None) -> None:
        """What the trainer refuses whatever the data: model and parallel layout, LoRA, schedule,
        the features not implemented yet and, given ``world_size``, the grid and the batch split
        (tools' plan checks this, so it never prints a plan the trainer would refuse)."""
        validate_model_parallel(self.model, self.parallel)
        self.train.validate()
        if self.lora is not None:
            self.lora.validate()
        # positions past max_seq_len have no rotary/position entry the model was built for: a longer
        # sample would run until memory runs out, or train positions inference never sees
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len={self.data.seq_len} is invalid: longer than the model's positions, "
                              f"model.max_seq_len={self.model.max_seq_len}")
        # CP cuts every sequence into 2*cp chunks; under SP each rank's two chunks are cut over TP
        check_cp_length(self.data.seq_len, self.parallel.cp, "data.seq_len")
        if self.parallel.cp > 1 and self.parallel.sequence_parallel and (self.data.seq_len // self.parallel.cp) % self.parallel.tp:
            raise ConfigError(f"data.seq_len {self.data.seq_len} / parallel.cp={self.parallel.cp} is not divisible by "
                              f"parallel.tp={self.parallel.tp} (sequence parallelism cuts each rank's tokens over TP)")
        check_pipeline_support(self.model, self.parallel)
        sparse = [k.mixer for k in self.model.parsed_layout().layers if k.mixer in ("D", "I")]
        if self.train.indexer.mode is not None and not sparse:
            raise ConfigError(f"train.indexer.mode={self.train.indexer.mode!r} is invalid: model.layout "
                              f"{self.model.layout!r} has no D or I layer (no indexer to train)")
        if self.train.indexer.mode is not None and self.lora is not None:
            raise ConfigError(f"train.indexer.mode={self.train.indexer.mode!r} is invalid with a lora section: the "
                              "indexer trains its own weights (full fine-tuning), not adapters")
        moe = self.model.moe
        if self.lora is not None and moe is not None and moe.redundant_experts:
            raise ConfigError(f"model.moe.redundant_experts={moe.redundant_experts} is invalid with a lora section: "
                              "adapters on replicated experts are not supported (fine-tune without replicas)")
        if world_size is not None:
            self.parallel.validate(world_size)
            self.train.micro_batches(self.parallel.dp(world_size))


def recipe_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of a shipped recipe (``tiny_dense``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = RECIPE_DIR / f"{p.stem}.yaml"
    if p.suffix in ("", ".yaml") and p.parent == Path(".") and shipped.is_file():
        return shipped
    names = ", ".join(sorted(x.stem for x in RECIPE_DIR.glob("*.yaml")))
    raise ConfigError(f"recipe {str(name_or_path)!r} not found (a YAML path or one of: {names})")


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def _parse_overrides(overrides: Sequence[str]):
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise one_line(e, "overrides") from None


def load_config(schema: type, path: str | Path | None = None, overrides: Sequence[str] = (),
                section: str | None = None, record: bool = False) -> Any:
    """Merge ``schema`` defaults <- YAML file (or one ``section`` of it) <- overrides.

    Unknown keys and wrong types are one-line ``ConfigError``s naming the key. ``record``: the
    result is saved as a run's record, so values read from the environment are refused
    (``refuse_environment``).
    """
    base = OmegaConf.structured(schema)
    layers = []
    source = "defaults"
    if path is not None:
        file = recipe_path(path)
        source = str(file)
        try:
            loaded = OmegaConf.load(file)
        except Exception as e:  # yaml errors carry multi-line context
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{file}: not a valid YAML recipe ({first})") from None
        if not isinstance(loaded, DictConfig):  # a list or a scalar at the top
            raise ConfigError(f"{file}: a recipe is a mapping of sections (model:, data:, ...), "
                              f"not a {type(loaded).__name__}")
        if section is not None:
            loaded = loaded.get(section, OmegaConf.create({}))
        layers.append((source, loaded))
    if overrides:
        layers.append(("overrides", _parse_overrides(overrides)))
    merged = base
    for src, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise one_line(e, src) from None
    if record:
        refuse_environment(OmegaConf.to_container(merged, resolve=False), source)
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise one_line(e, source) from None


ENV = re.compile(r"\$\{\s*(oc\.env|env)\s*:")


def refuse_environment(raw, source: str, key: str = "") -> None:
    """A training recipe is the run's record (recipe.yaml, meta.json, W&B): a value read from the
    environment (``${oc.env:X}``) would copy it there, secrets included, so it is refused in one
    line naming the key; pass the value itself as an override instead."""
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
    for k, value in items:
        path = f"{key}.{k}" if key and isinstance(k, str) else f"{key}[{k}]" if key else str(k)
        if isinstance(value, str) and ENV.search(value):
            raise ConfigError(f"{source}: {path}: {value!r} reads the environment, which a training run would record "
                              f"in recipe.yaml and meta.json (secrets included); give the value itself ({path}=...)")
        refuse_environment(value, source, path)


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = (),
                schema: type = Recipe) -> Any:
    """Load a recipe and validate each section on its own."""
    recipe = load_config(schema, path, overrides)
    recipe.model.validate()
    recipe.parallel.validate()
    return recipe


def load_train_recipe(path, overrides: Sequence[str] = (), validate: bool = True) -> Recipe:
    """A training recipe; ``validate=False`` leaves the runtime sections unchecked (planning). A
    validated recipe is one a run will record, so it may not read the environment (``${oc.env:X}``)."""
    recipe = load_config(Recipe, path, overrides, record=validate)
    if validate:
        recipe.validate()
    return recipe
