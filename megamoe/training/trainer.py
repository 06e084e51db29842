"""The training loop on the megatron-core grid: DP (+ZeRO-1), TP/SP, PP (1F1B), EP, CP.

One optimizer step consumes one global batch of ``train.global_batch_size`` samples; data
parallel rank r of D takes its slice, split into micro-batches. The ranks of a CP group share
a data-parallel rank: each gets the same full samples and the model cuts them to its chunks
(``megamoe.model.language_model``). The loss of every micro-batch is divided by the global number of target
tokens, so gradients are plain sums (over ``dp_cp``) and any layout reproduces the
single-process run.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megamoe.data import BatchLayout, TrainData
from megamoe.core.errors import CheckpointError, ConfigError, DataError, MegamoeError
from megamoe.core.layout import MOE_LETTERS
from megamoe.planning.plan import budget
from megamoe.planning.traffic import describe_ep_span
from megamoe.parallel import comm
from megamoe.parallel.cross_entropy import IGNORE_INDEX
from megamoe.parallel.groups import ParallelGroups, build_groups, init_distributed
from megamoe.parallel.topology import node_size
from megamoe.core.config_io import config_to_dict
from megamoe.checkpoint import dcp as ckpt
from megamoe.training.config import TrainConfig
from megamoe.training.grad_overlap import OverlappedGradSync
from megamoe.training.grads import clip_grads, global_grad_norm, sync_grads
from megamoe.training.faults import describe, is_collective_failure
from megamoe.training.guards import CheckpointMismatch, check_unchanged, run_record
from megamoe.training.monitor import Monitor, memory_gib, peak_tflops
from megamoe.training.mtp_loss import MTPLoss
from megamoe.training.optimizer import DistributedOptimizer, lr_at
from megamoe.training import reports
from megamoe.training.pipeline import build_chunks, build_schedule, timed_p2p
from megamoe.model.weights import initialize

log = logging.getLogger(__name__)

class NonFiniteStop(MegamoeError, RuntimeError):
    """Raised after ``train.nan_max_consecutive`` skipped steps; nothing is saved, so ``latest``
    stays the last checkpoint written before the streak (periodic saves pause during one)."""


def _device(train: TrainConfig) -> torch.device:
    if train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available()):
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def meta_tower(model_cfg):
    """The model's vision tower on the meta device: what an image costs in placeholder tokens
    (``image_tokens``) depends on the config only, so data can be checked before any weight exists."""
    from megamoe.vision.tower import VisionTower

    with torch.device("meta"):
        return VisionTower(model_cfg.vision, model_cfg.hidden_size, device="meta")


class Trainer:
    def __init__(self, recipe, dataset=None, groups: ParallelGroups | None = None):
        """``recipe``: a ``megamoe.recipe.Recipe`` (the runtime reads every section of it).
        ``dataset``: a map-style dataset of samples {"input_ids": [s], "labels": [s], ...}
        (see megamoe.data.build_dataset); the sample order comes from ``recipe.data``."""
        recipe.validate()
        self.recipe, self.dataset = recipe, dataset
        self.train, self.optim_cfg = recipe.train, recipe.optim
        self.device = _device(self.train)
        init_distributed(timeout_minutes=self.train.collective_timeout_s / 60, device=self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.groups = groups or build_groups(recipe.parallel, self.train.collective_timeout_s)
        span = describe_ep_span(recipe, recipe.parallel, self.world, node_size(recipe.parallel, self.world))
        if span and self.rank == 0:  # EP may cross nodes (TP/ETP may not: build_groups refused them)
            log.warning("%s", span)
        self.phase = "setup"  # the part of the step in progress, for CollectiveFailure
        self.dp = self.groups.size("dp")  # CP ranks share a data-parallel rank (and its samples)
        self.n_micro = self.train.micro_batches(self.dp)
        torch.manual_seed(self.train.seed * 1009 + self.rank)
        self.chunks, self.stage_ids = build_chunks(recipe.model, recipe.parallel, self.groups, fp8=self.train.fp8)
        self.base_weights = recipe.checkpoint.load or self._lora_base_of_resume()
        for chunk in self.chunks:
            if not self._weights_will_load():  # else the shards stay empty until the checkpoint fills them
                initialize(chunk, self.groups, self.train.seed)
            chunk.to(self.device)
            chunk.set_recompute(self.train.recompute)
            chunk.train()
        self.n_stages = recipe.parallel.pp * recipe.parallel.vpp
        self.first = self.stage_ids[0] == 0
        self.last = self.stage_ids[-1] == self.n_stages - 1
        self.step, self.consumed, self.nan_streak, self.skipped = 0, 0, 0, 0
        self.best_eval_loss = math.inf  # eval.save_best: the lowest validation loss so far
        self.saved_step = None  # the step of the checkpoint last written or resumed from
        self.pending_save, self._async_group = None, None  # checkpoint.async_save
        self.hf_origin = None  # the HF family/config the weights came from, kept for export
        if self.base_weights:
            check_unchanged(Path(self.base_weights), ckpt.read_meta(self.base_weights),
                            {"model": config_to_dict(recipe.model)}, recipe.checkpoint.allow_changes, "load weights")
            meta = ckpt.load_checkpoint(self.base_weights, self.groups, self.chunks, None, load_rng=False)
            self.hf_origin = meta.get("hf")
        if recipe.lora is not None:
            self._apply_lora()
        if self.train.indexer.mode is not None:  # (warm-up freezes all but the indexers: before the optimizer)
            from megamoe.training.indexer import setup_indexer_training

            setup_indexer_training(self.chunks, self.train.indexer, self.train.global_batch_size * recipe.data.seq_len)
        self.mtp = MTPLoss(recipe, self.chunks, self.groups, self.last)  # frozen unless train.mtp_loss_weight > 0
        self.expert_store = self._open_expert_store()
        named = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.optimizer = DistributedOptimizer(named, self.groups, self.optim_cfg, offload=self.train.optimizer_offload)
        # data-parallel gradient sums from backward hooks (after freezing: trainable parameters only)
        self.grad_sync = (OverlappedGradSync(self.chunks, self.groups, self.train.grad_bucket_size)
                          if self.train.overlap_grad_reduce else None)
        self._maybe_resume()
        self.after_step_hooks: list[Callable[[Trainer], None]] = []
        # communication latencies on every latency_interval-th step; None: no timing code at all
        self.recorder = comm.LatencyRecorder() if recipe.logging.latency_interval else None
        self.vision = getattr(self.chunks[0], "vision", None) if self.first else None
        self._preprocess = self.vision.preprocessor() if self.vision is not None else None
        self.has_moe = any(k.mlp in MOE_LETTERS for k in recipe.model.parsed_layout().layers)
        if self.has_moe:
            self._setup_moe()

    # ---- LoRA -----------------------------------------------------------------------------

    def _apply_lora(self) -> None:
        """Adapters on the loaded weights; the backbone and the router are frozen (docs/lora.md)."""
        from megamoe.lora import apply_lora, check_targets, trainable_count

        lora = self.recipe.lora
        if not self.base_weights:
            log.warning("lora: checkpoint.load is not set, so the adapters train on randomly initialised weights")
        check_targets(self.recipe.model, lora)  # against the whole model: a stage holds only its layers
        for chunk in self.chunks:
            apply_lora(chunk, lora, seed=self.train.seed, groups=self.groups, strict=False)
        counts = torch.tensor(trainable_count(self.chunks, self.groups), dtype=torch.float64, device=self.device)
        comm.all_reduce_tensor(counts, self.groups.pp)  # every stage holds its own layers
        trainable, total = (int(x) for x in counts.tolist())
        if self.rank == 0:
            print(f"LoRA: {trainable:,} trainable parameters of {total:,} ({100.0 * trainable / max(total, 1):.3f}%), "
                  f"rank {lora.rank}, alpha {lora.alpha:g}, expert adapters {lora.expert_adapters}; "
                  f"router frozen, expert-bias update {'on' if lora.update_expert_bias else 'off'}", flush=True)

    def _open_expert_store(self):
        """Tiered experts (``model.moe.expert_store``) read from the store, by default the weights
        being fine-tuned (``checkpoint.load``); they are frozen, so only under LoRA."""
        moe = self.recipe.model.moe
        if moe is None or not moe.expert_store.enabled:
            return None
        if self.recipe.lora is None:
            raise ConfigError("model.moe.expert_store.budget_mib is set but lora is not: tiered experts are frozen "
                              "(LoRA fine-tuning, inference); unset the budget to train the experts")
        from megamoe.expert_store import open_expert_store

        return open_expert_store(self.chunks, self.groups, self.base_weights, moe.placement)

    def _weights_will_load(self) -> bool:
        """Every model weight comes from a checkpoint: ``checkpoint.load`` (LoRA adapters are
        added and drawn afterwards), or a full-model resume."""
        c = self.recipe.checkpoint
        resuming = self.recipe.lora is None and c.dir and c.resume and ckpt.latest_checkpoint(c.dir) is not None
        return bool(self.base_weights or resuming)

    def _lora_base_of_resume(self) -> str | None:
        """The base weights an adapter-only checkpoint was trained on (resuming without checkpoint.load)."""
        c = self.recipe.checkpoint
        if self.recipe.lora is None or not (c.dir and c.resume):
            return None
        path = ckpt.latest_checkpoint(c.dir)
        return ckpt.read_meta(path).get("lora_base") if path is not None else None

    def _checkpoint_select(self):
        """LoRA runs write and read adapters only (the base comes from ``checkpoint.load``)."""
        if self.recipe.lora is None:
            return None
        from megamoe.lora import is_adapter_name

        return is_adapter_name

    # ---- MoE ------------------------------------------------------------------------------

    def _setup_moe(self) -> None:
        from megamoe.model.moe_controls import set_aux_loss_scale, update_expert_bias

        # each micro-batch's balancing losses weigh like its share of the global batch
        for chunk in self.chunks:
            set_aux_loss_scale(chunk, 1.0 / (self.n_micro * self.dp))
        lora = self.recipe.lora
        if self.train.indexer.mode == "warmup":  # the indexers learn from the model as loaded
            return
        if lora is None or lora.update_expert_bias:  # under LoRA the routing stays as loaded unless opted in
            self.after_step_hooks.append(lambda t: [update_expert_bias(c, t.groups) for c in t.chunks])

    def moe_report(self) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
        """Per-layer expert load and MoE scalars since the last report, on rank 0 (a collective;
        logging steps only; ``megamoe.training.reports``)."""
        return reports.moe_report(self)

    # ---- checkpoints ----------------------------------------------------------------------

    def state(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed, "nan_streak": self.nan_streak,
                "skipped_steps": self.skipped, "best_eval_loss": self.best_eval_loss}

    def save(self, root: str | Path | None = None, keep_last: int | None = None) -> Path | None:
        """A checkpoint of this step in ``checkpoint.dir`` (or ``root``: e.g. the best one, written
        synchronously); ``keep_last`` defaults to ``checkpoint.keep_last``."""
        best = root is not None
        root = root or self.recipe.checkpoint.dir
        if not root:
            return None
        extra = {"model": config_to_dict(self.recipe.model), "hf": self.hf_origin, "run": run_record(self.recipe)}
        if self.recipe.lora is not None:
            base = self.base_weights and str(Path(self.base_weights).resolve())
            extra.update(lora=config_to_dict(self.recipe.lora), lora_base=base)
        c = self.recipe.checkpoint
        asynchronous = c.async_save and not best
        self.phase = "checkpoint save"
        self.finish_save()  # one save in flight at a time
        if asynchronous and self._async_group is None and self.world > 1:
            self._async_group = dist.new_group(backend="gloo")  # the writer thread's own collectives
        out = ckpt.save_checkpoint(root, self.step, self.groups, self.chunks, self.optimizer, self.state(),
                                   keep_last or c.keep_last, extra, select=self._checkpoint_select(),
                                   asynchronous=asynchronous, async_group=self._async_group)
        if best:
            return out
        self.saved_step = self.step
        if asynchronous:
            self.pending_save = out
            return out.final
        return out

    def finish_save(self) -> None:
        """Complete the asynchronous save in flight, if any (a collective)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.wait()

    def _maybe_resume(self) -> None:
        """Continue from the newest intact checkpoint in ``checkpoint.dir``: one that cannot be
        read (truncated, corrupted) is skipped for the one before it, saying so; a checkpoint
        whose settings differ from the run's is the user's to resolve and stops the run."""
        c = self.recipe.checkpoint
        if not (c.dir and c.resume):
            return
        now = {"model": config_to_dict(self.recipe.model), "lora": self.recipe.lora and config_to_dict(self.recipe.lora),
               **run_record(self.recipe)}
        candidates = ckpt.checkpoints_newest_first(c.dir)
        for i, path in enumerate(candidates):
            try:
                check_unchanged(path, ckpt.read_meta(path), now, c.allow_changes)
                meta = ckpt.load_checkpoint(path, self.groups, self.chunks, self.optimizer,
                                            select=self._checkpoint_select())
            except CheckpointMismatch:
                raise
            except CheckpointError as e:
                if i + 1 == len(candidates):
                    raise
                log.warning("%s; falling back to the checkpoint before it, %s", e, candidates[i + 1])
                continue
            state = meta["trainer_state"]
            self.hf_origin = meta.get("hf", self.hf_origin)
            self.step, self.consumed = state["step"], state["consumed_samples"]
            self.nan_streak, self.skipped = state.get("nan_streak", 0), state.get("skipped_steps", 0)
            self.best_eval_loss = state.get("best_eval_loss", math.inf)
            self.saved_step = self.step
            log.info("resumed from %s at step %d (%d samples consumed)", path, self.step, self.consumed)
            return

    # ---- one step --------------------------------------------------------------------------

    def _autocast(self):
        use_bf16 = self.device.type == "cuda" and self.train.precision in ("auto", "bf16")
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)

    def image_tokens(self, image) -> int:
        """Placeholders one raw image takes (the image-caption dataset's ``image_tokens``). Every
        pipeline stage builds the same samples (the last one needs their labels), so a stage
        without the tower asks a meta-device copy: the count depends on the config only."""
        if self.vision is None and getattr(self, "_meta_tower", None) is None:
            self._meta_tower = meta_tower(self.recipe.model)
        return (self.vision or self._meta_tower).image_tokens(image)

    def _sequence_inputs(self, mb: dict) -> dict:
        """Packed samples' ``documents`` and ``positions`` [b, S]: every stage's mixers read them."""
        return {key: mb[key].to(self.device) for key in ("documents", "positions") if key in mb}

    def _later_stage_inputs(self, mb: dict) -> dict:
        """A later pipeline stage's keyword inputs: the sequence inputs and the input ids (hash-routed
        MoE layers route by token)."""
        return {**self._sequence_inputs(mb), "token_ids": mb["input_ids"].to(self.device)}

    def _stage_inputs(self, mb: dict) -> tuple[torch.Tensor, dict]:
        """The first stage's input ids and keyword inputs: packed documents, and for a multimodal
        model its preprocessed images."""
        ids, extra = mb["input_ids"].to(self.device), self._sequence_inputs(mb)
        if "images" not in mb:
            return ids, extra
        if self._preprocess is None:
            raise ConfigError("data gives images but model.vision is not set")
        return ids, {**extra, "images": [self._preprocess(img).to(self.device) for img in mb["images"]]}

    def _loss_sum(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's tokens' loss sum (labels are the full sequence; the last chunk cuts them)."""
        return self.chunks[-1].loss_sum(local_logits, labels)

    def _forward_backward(self, micro: list[dict], total_tokens: torch.Tensor) -> torch.Tensor:
        """Sum of token losses of this rank's micro-batches (on the last stage, else 0)."""
        loss_sum = torch.zeros((), dtype=torch.float64)
        if self.n_stages == 1:
            chunk = self.chunks[0]
            for i, mb in enumerate(micro):
                ids, extra = self._stage_inputs(mb)
                with self._autocast():
                    logits = chunk.forward_stage(ids, **extra, **self.mtp.targets(mb, self.device))
                s = self._loss_sum(logits, mb["labels"].to(self.device))
                with self._backward_scope(i == len(micro) - 1):
                    (s / total_tokens).backward()
                loss_sum += s.detach().double().cpu()
            return loss_sum
        losses = self._pipeline_run(micro, lambda logits, labels: self._loss_sum(logits, labels) / total_tokens)
        for x in losses:
            loss_sum += x.detach().double().cpu() * total_tokens.double().cpu()
        return loss_sum

    def _backward_scope(self, last: bool):
        """Around a micro-batch's backward: the overlapped gradient sums act in the last one."""
        return self.grad_sync.last_backward(last) if self.grad_sync is not None else contextlib.nullcontext()

    @torch.no_grad()
    def forward_loss(self, micro: list[dict]) -> torch.Tensor:
        """Sum of token losses of this rank's micro-batches, forward only (on the last stage, else
        0; the validation loop's step)."""
        loss_sum = torch.zeros((), dtype=torch.float64)
        if self.n_stages > 1:
            for x in self._pipeline_run(micro, self._loss_sum, backward=False):
                loss_sum += x.double().cpu()
            return loss_sum
        for mb in micro:
            ids, extra = self._stage_inputs(mb)
            with self._autocast():
                logits = self.chunks[0].forward_stage(ids, **extra)
            loss_sum += self._loss_sum(logits, mb["labels"].to(self.device)).double().cpu()
        return loss_sum

    def _pipeline_run(self, micro: list[dict], loss_fn, backward: bool = True) -> list:
        """One pass of the pipeline schedule over ``micro`` (forward and backward, or forward
        only); the last stage's ``loss_fn(logits, labels)`` per micro-batch."""
        if not hasattr(self, "_schedule"):
            bf16 = self.device.type == "cuda" and self.train.precision in ("auto", "bf16")
            self._schedule, self._stage_modules = build_schedule(
                self.chunks, self.stage_ids, self.n_stages, self.groups, self.n_micro, loss_fn, self.device,
                self.train.micro_batch_size, self.recipe.data.seq_len, torch.bfloat16 if bf16 else torch.float32,
                backward_scope=self._backward_scope)
        self._schedule._loss_fn = loss_fn  # the token count differs per step
        # keyword inputs ride along per micro-batch: the first stage's images (the vision tower runs
        # inside it) and, on every stage, packed documents and their positions
        for sid, module in zip(self.stage_ids, self._stage_modules):
            module.extra = [{**(self._stage_inputs(mb)[1] if sid == 0 else self._later_stage_inputs(mb)),
                             **(self.mtp.targets(mb, self.device) if sid == self.n_stages - 1 else {})} for mb in micro]
        args = [(mb["input_ids"].to(self.device),) for mb in micro] if self.first else None
        targets = [mb["labels"].to(self.device) for mb in micro] if self.last else None
        losses: list = []
        run = self._schedule.step if backward else self._schedule.eval
        with self._autocast(), timed_p2p():
            run(arg_mbs=args, target_mbs=targets, losses=losses, return_outputs=False)
        return losses

    def _timing(self):
        """The latency recorder on sampled steps, else nothing."""
        every = self.recipe.logging.latency_interval
        if self.recorder is None or (self.step + 1) % every:
            return contextlib.nullcontext()
        return self.recorder.active()

    def train_step(self, micro: list[dict]) -> dict:
        """Forward, backward, gradient sync, clip and update on one global batch."""
        with self._timing():  # every collective of a sampled step, the gradient sync included
            return self._train_step(micro)

    def _train_step(self, micro: list[dict]) -> dict:
        if len(micro) != self.n_micro:
            raise ConfigError(f"data gave {len(micro)} micro-batches, train.global_batch_size needs {self.n_micro}")
        start = time.perf_counter()
        local_tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
        self.phase = "token count"
        # every CP rank holds the full labels: count over the data-parallel ranks only
        total_tokens = comm.all_reduce_tensor(torch.tensor(float(local_tokens), dtype=torch.float64),
                                              self.groups.dp).to(torch.float32)
        if total_tokens.item() == 0:  # the same sum on every rank: all of them stop here
            raise DataError(f"step {self.step + 1}: the global batch has no target tokens (every label is masked), "
                            f"so the loss would be 0 and nothing learned; check data.paths (SFT samples whose "
                            f"answers data.seq_len truncates away?)")
        self.mtp.start_step(micro)  # each MTP depth's target count (a collective over dp)
        self.optimizer.zero_grad()
        if self.grad_sync is not None:
            self.grad_sync.start_step()  # gradients accumulate in its buckets' buffers
        self.phase = "forward/backward"
        loss_sum = self._forward_backward(micro, total_tokens.to(self.device))
        self.phase = "gradient sync"
        if self.grad_sync is not None:
            self.grad_sync.finish()  # what backward hooks left, then wait for every bucket
        else:
            sync_grads(self.chunks, self.groups, self.train.grad_bucket_size)
        self.phase = "gradient norm"
        norm = global_grad_norm(self.chunks, self.groups)
        self.phase = "optimizer step"
        lr = lr_at(self.step, self.optim_cfg, self.train.steps)
        finite = math.isfinite(norm)
        if finite:
            clip_grads(self.optimizer.params, self.optim_cfg.clip_grad, norm)
            self.optimizer.step(lr)
            self.nan_streak = 0
        else:
            self.nan_streak += 1
            self.skipped += 1
            log.warning("step %d: gradient norm is %s; update skipped (%d in a row)", self.step + 1, norm,
                        self.nan_streak)
        self.optimizer.zero_grad()
        # the loss lives on the last stage; count it once per data-parallel replica
        counted = loss_sum if (self.last and self.groups.tp_rank == 0) else torch.zeros_like(loss_sum)
        self.phase = "loss reduction"
        total_loss = comm.all_reduce_tensor(counted, dist.group.WORLD) / total_tokens.double()
        mtp_metrics = self.mtp.report()  # mtp_loss: the depths' mean cross-entropy (a collective)
        self.step += 1
        self.consumed += self.train.global_batch_size
        if finite:
            for hook in self.after_step_hooks:  # e.g. the MoE expert-bias update
                hook(self)
        seconds = time.perf_counter() - start
        tokens = self.train.global_batch_size * self.recipe.data.seq_len
        return {"loss": total_loss.item(), **mtp_metrics, "lr": lr, "grad_norm": norm, "skipped": float(not finite),
                "seconds": seconds, "tokens_per_s": tokens / seconds}

    # ---- the loop ---------------------------------------------------------------------------

    def flops_per_token(self) -> float:
        """~6 x active matmul parameters (the embedding lookup is not a matmul)."""
        b = budget(self.recipe.model)
        embed = b.parts.get("embedding", (0, 0.0))[1] if not self.recipe.model.tie_embeddings else 0.0
        return 6.0 * (b.active - embed)

    def _nonfinite_message(self) -> str:
        root = self.recipe.checkpoint.dir
        latest = ckpt.latest_checkpoint(root) if root else None
        kept = f"{latest} stays latest" if latest else "no checkpoint was written"
        return (f"step {self.step}: {self.nan_streak} consecutive steps had a non-finite gradient norm; stopped "
                f"without saving, {kept}; lower optim.lr or inspect the data")

    def _loop(self, data, monitor: Monitor, flops: float, peak: float, history: list, evaluator=None) -> None:
        cfg = self.recipe
        while self.step < self.train.steps:
            metrics = self.train_step(data(self.consumed))
            if self.pending_save is not None:  # an async save overlaps one step, then becomes latest
                self.phase = "checkpoint save"
                self.finish_save()
            metrics.update(memory_gib())
            metrics["mfu"] = flops * metrics["tokens_per_s"] / (peak * 1e12 * self.world)
            reports.report_step(self, monitor, metrics, evaluator)
            history.append(metrics)
            if self.nan_streak >= self.train.nan_max_consecutive:
                self.finish_save()
                raise NonFiniteStop(self._nonfinite_message())
            every = cfg.checkpoint.save_interval
            if every and self.step % every == 0 and self.step < self.train.steps and not self.nan_streak:
                self.save()
        if self.saved_step != self.step:
            self.save()
        elif self.rank == 0:
            log.info("checkpoint step %d already reaches train.steps=%d: nothing to train", self.step,
                     self.train.steps)
        self.finish_save()

    def fit(self, log_dir: str | Path | None = None, dataset=None, valid_dataset=None) -> list[dict]:
        """Train until ``train.steps``, evaluating on ``valid_dataset`` as ``eval`` says; returns
        the per-step metrics of this run (``eval_loss``/``eval_ppl`` on evaluation steps)."""
        self.dataset = dataset if dataset is not None else self.dataset
        if self.dataset is None:
            raise ConfigError("data: the trainer has no dataset")
        cfg = self.recipe
        evaluator = None
        if cfg.eval.enabled:
            if valid_dataset is None:
                raise ConfigError("eval.interval is set but the trainer has no validation dataset (eval.paths or "
                                  "eval.split)")
            from megamoe.training.evaluate import Evaluator

            evaluator = Evaluator(self, valid_dataset, cfg.eval)
        layout = BatchLayout(self.train.global_batch_size, self.train.micro_batch_size, self.dp,
                             self.groups.rank("dp"))
        data = TrainData(self.dataset, layout, cfg.data.seed, cfg.data.shuffle, self.consumed, cfg.data.num_workers)
        log_dir = log_dir or cfg.logging.dir or (Path(cfg.checkpoint.dir) / "tb" if cfg.checkpoint.dir else "runs")
        moe = cfg.model.moe
        figure = {"ep": cfg.parallel.ep, "placement": moe.placement if moe is not None else None}
        monitor = Monitor(log_dir, cfg.logging, self.train.steps, self.step, enabled=self.rank == 0,
                          figure_info=figure, run_config=config_to_dict(cfg) if cfg.logging.wandb.enabled else None)
        peak = peak_tflops(cfg.logging, self.device) if self.rank == 0 else 1.0
        flops = self.flops_per_token()
        history = []
        try:
            self._loop(data, monitor, flops, peak, history, evaluator)
        except RuntimeError as e:  # torch's DistBackendError is one
            if isinstance(e, MegamoeError) or not is_collective_failure(e):
                raise
            step = self.step if self.phase in ("metrics report", "checkpoint save") else self.step + 1
            raise describe(e, step, self.phase, self.groups, self.rank, self.train.collective_timeout_s) from None
        finally:
            monitor.close()
        return history
