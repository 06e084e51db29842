"""The recipe's ``lora`` section (no postponed annotations here: OmegaConf reads them)."""
from dataclasses import dataclass, field
from typing import List

from megamoe.core.config import check, check_choice, check_positive

EXPERT_ADAPTERS = ("per_expert", "shared")


@dataclass
class LoRAConfig:
    """Low-rank adapters on a frozen model: ``W x + scale * B A dropout(x)``.

    rank, alpha: ``scale = alpha / rank`` (``alpha / sqrt(rank)`` with ``rslora``).
    targets: module-name patterns (fnmatch globs) matched against each adaptable module's full
        name or any dotted suffix of it, e.g. ``linear_qkv``, ``layers.3.*``, ``experts``,
        ``shared_experts.*``. Adaptable modules are the linear roles (column/row-parallel and
        replicated linears: every mixer projection, dense and shared-expert MLPs) and the
        routed experts (both weights of each expert). ``["*"]``: all of them. A pattern that
        matches nothing is an error. The router, norms, embedding and output layer are never
        adapted.
    exclude: patterns removed from the targets (the same matching).
    expert_adapters: ``per_expert`` (a pair per routed expert, stacked [E, ...] and split over
        EP like the experts) or ``shared`` (one pair for all routed experts). Both mean the
        same thing at every EP/ETP size.
    update_expert_bias: opt in to the aux-loss-free expert-bias update while fine-tuning. Off,
        the router (weights and bias) is frozen, so routing is a fixed function of its input.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    rslora: bool = False
    targets: List[str] = field(default_factory=lambda: ["*"])
    exclude: List[str] = field(default_factory=list)
    expert_adapters: str = "per_expert"
    update_expert_bias: bool = False

    def __post_init__(self):
        # the Python API takes a single pattern or any sequence of them
        for name in ("targets", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)

    def validate(self, path: str = "lora") -> None:
        check_positive(f"{path}.rank", self.rank)
        check(self.alpha > 0, f"{path}.alpha", self.alpha, "must be > 0")
        check(0.0 <= self.dropout < 1.0, f"{path}.dropout", self.dropout, "must be in [0, 1)")
        check(len(self.targets) > 0, f"{path}.targets", list(self.targets), "must name at least one pattern")
        check_choice(f"{path}.expert_adapters", self.expert_adapters, EXPERT_ADAPTERS)
