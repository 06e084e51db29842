"""Configs of the training runtime: one dataclass per component (no postponed annotations:
OmegaConf reads them)."""
from dataclasses import dataclass, field
from typing import List, Optional

from megamoe.core.config import check, check_choice, check_positive

PRECISIONS = ("auto", "fp32", "bf16")
FP8_CHOICES = ("torch", "delayed", "current", "blockwise", "mxfp8")
GUARDED = ("model", "lora", "data", "eval", "train", "optim")  # the sections resume guards compare
INDEXER_MODES = ("warmup", "sparse")
WANDB_MODES = ("online", "offline", "disabled")
GRAD_BUCKET_ELEMENTS = 1 << 24  # gradient elements summed per data-parallel collective (train.grad_bucket_size)


@dataclass
class OptimConfig:
    """AdamW with warmup + cosine decay, gradient clipping and ZeRO-1 state sharding."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    decay_steps: Optional[int] = None  # None: train.steps - warmup_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    zero1: bool = True  # shard optimizer state over data-parallel ranks

    def validate(self, path: str = "optim") -> None:
        check(self.lr > 0, f"{path}.lr", self.lr, "must be > 0")
        check(0 <= self.min_lr <= self.lr, f"{path}.min_lr", self.min_lr, f"must be in [0, lr={self.lr}]")
        check(self.warmup_steps >= 0, f"{path}.warmup_steps", self.warmup_steps, "must be >= 0")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"{path}.beta1/beta2", (self.beta1, self.beta2),
              "must be in [0, 1)")
        check(self.clip_grad >= 0, f"{path}.clip_grad", self.clip_grad, "must be >= 0")
        check(self.weight_decay >= 0, f"{path}.weight_decay", self.weight_decay, "must be >= 0")


@dataclass
class IndexerTrainConfig:
    """Training the lightning indexer of the D/I layers as DeepSeek-V3.2 does (docs/training.md).

    ``warmup``: attention stays dense and everything but the indexers is frozen; each indexer
    learns the KL divergence to its layer's attention distribution (summed over heads,
    L1-normalised) over all causal keys. ``sparse``: attention reads the indexer's top-k, the
    whole model trains on the language-model loss and each indexer on the KL restricted to the
    keys it selected; its inputs are detached, so each loss trains only its own part.
    null (the default): the indexer selects as loaded and is not trained. (Not "off": YAML
    reads that as false.)"""

    mode: Optional[str] = None
    loss_coeff: float = 1.0  # weight of the indexer KL (mean over query tokens) in the gradient

    def validate(self, path: str = "train.indexer") -> None:
        if self.mode is not None:
            check_choice(f"{path}.mode", self.mode, INDEXER_MODES)
        check(self.loss_coeff > 0, f"{path}.loss_coeff", self.loss_coeff, "must be > 0")


@dataclass
class TrainConfig:
    steps: int = 100
    micro_batch_size: int = 2
    global_batch_size: int = 8  # samples per optimizer step, over all data-parallel ranks (length: data.seq_len)
    seed: int = 1234
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    recompute: List[str] = field(default_factory=list)  # any of: layer, mixer, mlp, core
    nan_max_consecutive: int = 5  # skipped non-finite steps in a row before save-and-stop
    device: str = "auto"  # auto: cuda if available, else cpu
    # seconds a collective may wait for its peers before the run stops with one line naming the
    # step and group (process-group timeout; a hung or dead rank otherwise hangs the job)
    collective_timeout_s: float = 1800.0
    optimizer_offload: bool = False  # fp32 masters + Adam moments in (pinned) host memory, updated there
    # FP8 GEMMs: torch (row-wise scaled torch._scaled_mm, model.backend=cuda); delayed, current,
    # blockwise, mxfp8: Transformer Engine recipes (model.backend=te). None: off
    fp8: Optional[str] = None
    indexer: IndexerTrainConfig = field(default_factory=IndexerTrainConfig)  # D/I layers' indexer training
    # multi-token-prediction loss weight lambda (DeepSeek-V3): + lambda * the mean over model.mtp's
    # depths of each depth's cross-entropy; 0: the MTP depths do not train (frozen)
    mtp_loss_weight: float = 0.0
    # sum each bucket of data-parallel gradients as soon as backward has finished it (asynchronous,
    # from backward hooks, in the last micro-batch), overlapped with the rest of the backward;
    # false: all of them after the whole backward (the reference; the same sums, bitwise)
    overlap_grad_reduce: bool = True
    grad_bucket_size: int = GRAD_BUCKET_ELEMENTS  # gradient elements per data-parallel bucket

    def validate(self, path: str = "train") -> None:
        self.indexer.validate(f"{path}.indexer")
        for name in ("steps", "micro_batch_size", "global_batch_size", "nan_max_consecutive", "grad_bucket_size"):
            check_positive(f"{path}.{name}", getattr(self, name))
        check(self.collective_timeout_s > 0, f"{path}.collective_timeout_s", self.collective_timeout_s, "must be > 0")
        check_choice(f"{path}.precision", self.precision, PRECISIONS)
        check(self.mtp_loss_weight >= 0, f"{path}.mtp_loss_weight", self.mtp_loss_weight, "must be >= 0")
        check_choice(f"{path}.device", self.device, ("auto", "cpu", "cuda"))
        if self.fp8 is not None:
            check_choice(f"{path}.fp8", self.fp8, FP8_CHOICES)
        for part in self.recompute:
            check_choice(f"{path}.recompute", part, ("layer", "mixer", "mlp", "core"))

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        per_rank = self.micro_batch_size * dp
        check(self.global_batch_size % per_rank == 0, "train.global_batch_size", self.global_batch_size,
              f"must be a multiple of micro_batch_size*dp={self.micro_batch_size}*{dp}")
        return self.global_batch_size // per_rank


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # where step_XXXXXXX/ folders go; None: no checkpoints
    save_interval: int = 0  # steps between saves; 0: only at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    resume: bool = True  # continue from the latest complete checkpoint in dir
    load: Optional[str] = None  # initial weights: a megamoe checkpoint dir (e.g. converted from HF)
    # settings that may differ from the checkpoint's on resume/load (e.g. [model.moe.top_k] or [optim]);
    # any other difference in model, lora, data, train.{global_batch_size,seed,precision,fp8} or optim is refused
    allow_changes: List[str] = field(default_factory=list)
    # write checkpoints in a background thread (DCP async save) while training goes on; the save
    # becomes latest only when complete: after the next step (the write overlaps it) or at the run's end
    async_save: bool = False

    def validate(self, path: str = "checkpoint") -> None:
        check(self.save_interval >= 0, f"{path}.save_interval", self.save_interval, "must be >= 0")
        check_positive(f"{path}.keep_last", self.keep_last)
        for name in self.allow_changes:
            check(name.split(".")[0] in GUARDED, f"{path}.allow_changes", name,
                  f"must name a field of one of {', '.join(GUARDED)}")


@dataclass
class EvalConfig:
    """Validation during training (Megatron's --eval-interval, --eval-iters, --split /
    --valid-data-path): the loss and perplexity of held-out data every ``interval`` steps and
    at the last step. Every evaluation reads the same samples: the first ``iters`` global
    batches of the validation data's order (seeded by ``data.seed``)."""

    interval: int = 0  # steps between evaluations; 0: never
    iters: int = 10  # global batches (train.global_batch_size samples) per evaluation
    # validation data: the same kind, tokenizer and seq_len as ``data``; Megatron's weighted form allowed
    paths: List[str] = field(default_factory=list)
    # or hold out the last ``split`` of the training data (each source cut at a document start)
    split: float = 0.0
    save_best: bool = False  # keep the checkpoint of the lowest validation loss in <checkpoint.dir>/best

    def validate(self, path: str = "eval") -> None:
        check(isinstance(self.interval, int) and self.interval >= 0, f"{path}.interval", self.interval,
              "must be an integer >= 0 (0: never)")
        check_positive(f"{path}.iters", self.iters)
        check(0.0 <= self.split < 1.0, f"{path}.split", self.split, "must be in [0, 1)")
        check(not (self.paths and self.split), f"{path}.split", self.split,
              f"validation data comes from {path}.paths or {path}.split, not both")
        check(self.interval == 0 or bool(self.paths) or self.split > 0, f"{path}.interval", self.interval,
              f"needs validation data: set {path}.paths or {path}.split")
        check(not self.save_best or self.interval > 0, f"{path}.save_best", self.save_best,
              f"needs {path}.interval > 0")

    @property
    def enabled(self) -> bool:
        return self.interval > 0


@dataclass
class WandbConfig:
    """Weights & Biases logging beside TensorBoard (the same scalars); on when ``project`` is set.
    Needs ``pip install megamoe[wandb]``; ``mode: offline`` writes the run under ``dir`` for a
    later ``wandb sync``."""

    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None  # the run's name (default: W&B's)
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    mode: str = "online"
    dir: Optional[str] = None  # default: logging.dir

    def validate(self, path: str = "logging.wandb") -> None:
        check_choice(f"{path}.mode", self.mode, WANDB_MODES)
        check(self.project is None or (isinstance(self.project, str) and bool(self.project.strip())),
              f"{path}.project", self.project, "must be a non-empty name (or null: no W&B)")

    @property
    def enabled(self) -> bool:
        return self.project is not None and self.mode != "disabled"


@dataclass
class LoggingConfig:
    dir: Optional[str] = None  # TensorBoard log dir; None: <checkpoint.dir>/tb or runs/<time>
    interval: int = 1  # steps between scalar logs
    heatmap_interval: int = 10  # steps between expert-load heatmaps
    latency_interval: int = 10  # time every collective (per group, size, layer) on every N-th step; 0: never
    peak_tflops: Optional[float] = None  # for MFU; None: known GPUs, or a measured matmul peak on CPU
    progress: bool = True  # console progress bar
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases (off unless wandb.project)

    def validate(self, path: str = "logging") -> None:
        self.wandb.validate(f"{path}.wandb")
        check_positive(f"{path}.interval", self.interval)
        check_positive(f"{path}.heatmap_interval", self.heatmap_interval)
        check(self.latency_interval >= 0, f"{path}.latency_interval", self.latency_interval, "must be >= 0")
