"""Tiered expert storage (``model.moe.expert_store``): LoRA fine-tunes whose frozen experts stay
in a store on disk give the loss curve of the all-resident run, in one process and at EP=2
(gloo), while the process holds a quarter of the experts; bad stores fail in one line."""
from __future__ import annotations

import contextlib
import copy
import io
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megamoe.core.config import AttentionConfig, ExpertStoreConfig, ModelConfig, MoEConfig, ParallelConfig
from megamoe.core.errors import CheckpointError, ConfigError

STEPS = 4


def moe_heavy_config(hidden: int = 256, experts: int = 16, ffn: int = 384) -> ModelConfig:
    """Four MoE layers whose experts are most of the weights (4 x 16 x 3 x 256 x 384 fp32 = 72 MiB)."""
    return ModelConfig(vocab_size=64, hidden_size=hidden, layout="AeAeAeAe", fusion="off",
                       attention=AttentionConfig(num_heads=4, num_kv_heads=2),
                       moe=MoEConfig(num_experts=experts, top_k=2, moe_ffn_hidden_size=ffn, num_shared_experts=1))


def experts_bytes(cfg: ModelConfig) -> int:
    m = cfg.moe
    layers = sum(k.mlp == "e" for k in cfg.parsed_layout().layers)
    return layers * m.num_experts * 3 * cfg.hidden_size * m.moe_ffn_hidden_size * 4


def write_store(cfg: ModelConfig, out) -> str:
    from megamoe.model.language_model import LanguageModel
    from megamoe.expert_store import save_converted
    from megamoe.model.weights import initialize

    model = LanguageModel(cfg)
    initialize(model, model.groups, 0)
    return str(save_converted(model, cfg, out))


def peak_rss() -> int:
    """This process's peak resident set (VmHWM: anonymous and mapped file pages), bytes."""
    from megamoe.diagnostics.memory import peak_rss_mib

    return int(peak_rss_mib() * 2**20)


def finetune(store: str, log_dir: str, budget_mib: float | None, parallel: dict | None = None,
             steps: int = STEPS, recompute: list[str] | None = None, store_path: str | None = None,
             mapped: bool = True) -> dict:
    """LoRA steps from the converted checkpoint ``store`` (its own model), experts tiered under
    ``budget_mib`` (None: resident) and read from ``store_path`` (default ``store``), mapped in
    place or copied into slots, ``train.recompute`` = ``recompute``: losses, peak RSS and the
    store's counters."""
    from megamoe.data import DataConfig
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.lora import LoRAConfig
    from megamoe.core.config_io import config_from_dict
    from megamoe.checkpoint.dcp import read_meta
    from megamoe.training.config import CheckpointConfig, LoggingConfig, OptimConfig, TrainConfig
    from megamoe.recipe import Recipe as TrainRecipe
    from megamoe.training.trainer import Trainer

    model = config_from_dict(read_meta(store)["model"])
    model.moe.expert_store = ExpertStoreConfig(budget_mib=budget_mib, path=store_path, map=mapped,
                                               prefetch=os.environ.get("PF", "1") == "1")
    recipe = TrainRecipe(model=model, parallel=ParallelConfig(**(parallel or {})),
                         data=DataConfig(kind="synthetic", seq_len=32, seed=3),
                         train=TrainConfig(steps=steps, micro_batch_size=2, global_batch_size=4, seed=7,
                                             recompute=list(recompute or [])),
                         optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.0),
                         checkpoint=CheckpointConfig(load=store),
                         logging=LoggingConfig(progress=False, latency_interval=0),
                         lora=LoRAConfig(rank=4, alpha=8.0))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(recipe, SyntheticDataset(model.vocab_size, 32, seed=5))
        history = trainer.fit(log_dir)
    stats = trainer.expert_store.stats() if trainer.expert_store is not None else None
    return {"losses": [h["loss"] for h in history], "peak_rss": peak_rss(), "stats": stats}


def in_fresh_process(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a new process (its peak RSS is its own, not this test process's)."""
    from tests.dist import DistPool

    pool = DistPool(1)
    try:
        return pool.run(fn, *args, **kwargs)[0]
    finally:
        pool.close()


def test_tiered_lora_finetune_matches_resident_in_a_quarter_of_the_experts(tmp_path):
    """budget = a quarter of the experts' bytes, experts mapped in place (their pages count in
    the RSS) and copied into slots: the same losses (<= 1e-6, fp32), and the peak RSS at least
    three quarters of the experts' bytes below the resident run's, less a margin of 1/16 of the
    experts' bytes + 16 MiB (host allocator slack, the prefetch thread)."""
    cfg = moe_heavy_config()
    store = write_store(cfg, tmp_path / "store")
    e_bytes = experts_bytes(cfg)
    # three fresh processes side by side (each peak RSS is its own process's)
    with ThreadPoolExecutor(3) as ex:
        resident = ex.submit(in_fresh_process, finetune, store, str(tmp_path / "resident"), None)
        runs = {mapped: ex.submit(in_fresh_process, finetune, store, str(tmp_path / f"tiered{mapped}"),
                                  e_bytes / 4 / 2**20, mapped=mapped) for mapped in (True, False)}
        resident, runs = resident.result(), {mapped: run.result() for mapped, run in runs.items()}
    for mapped, tiered in runs.items():
        diff = max(abs(a - b) for a, b in zip(resident["losses"], tiered["losses"]))
        assert len(tiered["losses"]) == STEPS and diff <= 1e-6, (mapped, resident["losses"], tiered["losses"])
        margin = e_bytes // 16 + (16 << 20)
        saved = resident["peak_rss"] - tiered["peak_rss"]
        assert tiered["peak_rss"] <= resident["peak_rss"] - 0.75 * e_bytes + margin, \
            (mapped, saved / 2**20, e_bytes / 2**20)
        stats = tiered["stats"]
        assert stats["mapped"] == mapped and 0 < stats["cached_bytes"] <= stats["capacity_bytes"] <= e_bytes / 4, stats
        assert stats["misses"] > 0 and stats["read_bytes"] > e_bytes, stats  # experts really came from the files


def ep_curve(store: str, log_dir: str, budget_mib: float | None) -> list[float]:
    return finetune(store, log_dir, budget_mib, {"ep": 2}, steps=3)["losses"]


def test_tiered_experts_at_ep2_match_one_process(pool, tmp_path):
    """EP=2 over gloo, each rank's store holding its own experts: the single-process resident curve."""
    cfg = moe_heavy_config(hidden=64, experts=8, ffn=64)
    store = write_store(cfg, tmp_path / "store")
    one = finetune(store, str(tmp_path / "one"), None, steps=3)["losses"]
    budget = experts_bytes(cfg) / 8 / 2**20
    runs = pool(2).run(ep_curve, store, str(tmp_path / "ep2"), budget)
    for losses in runs:
        assert max(abs(a - b) for a, b in zip(one, losses)) <= 1e-6, (one, losses)


# ---- the layer and the store directly -------------------------------------------------------

def stored_pair(tmp_path, budget_mib: float, kernel: str = "auto", expert_adapters: str = "per_expert",
                 tier: str = "disk", mapped: bool = True, device: str = "cpu"):
    """(resident model, tiered model, its open store) on ``device``, same weights and adapters."""
    from megamoe.lora import LoRAConfig, apply_lora
    from megamoe.model.language_model import LanguageModel
    from megamoe.expert_store import open_expert_store
    from megamoe.checkpoint.dcp import load_checkpoint
    from tests.lora_utils import randomize_adapters

    cfg = moe_heavy_config(hidden=32, experts=8, ffn=16)
    cfg.moe.expert_kernel = kernel
    store_dir = write_store(cfg, tmp_path / "store")
    models = []
    for budget in (None, budget_mib):
        c = copy.deepcopy(cfg)
        c.moe.expert_store = ExpertStoreConfig(budget_mib=budget, path=store_dir if budget else None, tier=tier,
                                               map=mapped)
        model = LanguageModel(c)
        load_checkpoint(store_dir, model.groups, [model], load_rng=False)
        lora = LoRAConfig(rank=4, alpha=8.0, expert_adapters=expert_adapters if expert_adapters != "none" else
                          "per_expert", exclude=["*.experts"] if expert_adapters == "none" else [])
        apply_lora(model, lora)
        randomize_adapters(model)
        models.append(model.to(device))
    return models[0], models[1], open_expert_store([models[1]], models[1].groups)


def check_stored_matches_resident(resident, tiered, store) -> None:
    """Outputs and every adapter gradient of a forward+backward on both models agree (1e-6
    relative), experts came from the store, and the tiered model holds no expert weight."""
    device = next(p for p in resident.parameters()).device
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    outs = []
    for model in (resident, tiered):
        out = model(ids)
        out.float().pow(2).mean().backward()
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-6
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (resident, tiered)]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 8
    for n, g in grads[0].items():
        assert (g - grads[1][n]).abs().max().item() <= 1e-6 * max(1.0, g.abs().max().item()), n
    assert store.stats()["misses"] > 0
    assert not any(p.device.type != "meta" for n, p in tiered.named_parameters() if n.endswith("_weight")
                   and ".experts." in n)
    with torch.no_grad():  # forwards without a backward (decoding) leave no record behind
        tiered(ids)
        recorded = len(store.calls)
        for _ in range(3):
            tiered(ids)
        assert len(store.calls) == recorded


# 0.006 MiB: one expert (6144 bytes) and no cache, every call reads its expert
@pytest.mark.parametrize("kernel,budget,adapters,tier,mapped", [("loop", 0.006, "per_expert", "disk", True),
                                                                ("loop", 0.006, "per_expert", "disk", False),
                                                                ("reference", 0.05, "shared", "disk", True),
                                                                ("reference", 0.05, "shared", "disk", False),
                                                                ("loop", 1.0, "shared", "disk", True),
                                                                ("loop", 1.0, "shared", "disk", False),
                                                                ("loop", 0.05, "per_expert", "host", False),
                                                                ("loop", 0.05, "none", "disk", True)])
def test_tiered_layer_forward_and_backward_match_resident(tmp_path, kernel, budget, adapters, tier, mapped):
    """One expert per call without a cache (0.004 MiB), several per call with a cache, all
    cached, the host tier; experts mapped in place or copied into slots; no adapters on the
    experts (the frozen kernel's backward then makes no weight gradient: with mapped views
    that would be a whole layer's experts per call): outputs and every adapter gradient as
    with resident experts."""
    resident, tiered, store = stored_pair(tmp_path, budget, kernel, adapters, tier, mapped)
    assert store.mapped == mapped
    check_stored_matches_resident(resident, tiered, store)
    store.close()


def _mapping_rss(views) -> int:
    """Bytes of the store's file mappings resident in this process (``/proc/self/smaps``)."""
    starts = {w.untyped_storage().data_ptr() for pair in views.values() for w in pair}
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                inside = int(head.split("-")[0], 16) in starts
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def test_mapped_store_holds_its_budget_and_unmaps_everything(tmp_path):
    """Bringing every layer's experts in, call by call, the store's file pages mapped into the
    process stay within the capacity plus the huge pages at the ends of what is mapped (a
    fault may map a huge folio whole), and closing the store unmaps them all: nothing is left
    behind by the neighbours' pages that mapping an expert in also mapped."""
    from megamoe.model.language_model import LanguageModel
    from megamoe.expert_store import open_expert_store
    from megamoe.expert_store.mapped import HUGE
    from megamoe.checkpoint.dcp import load_checkpoint

    cfg = moe_heavy_config()
    store_dir = write_store(cfg, tmp_path / "store")
    cfg.moe.expert_store = ExpertStoreConfig(budget_mib=experts_bytes(cfg) / 8 / 2**20, path=store_dir,
                                             prefetch=False)
    model = LanguageModel(cfg)
    load_checkpoint(store_dir, model.groups, [model], load_rng=False)
    store = open_expert_store([model], model.groups)
    assert store.mapped
    views = store.cache.views
    assert _mapping_rss(views) == 0  # views alone map nothing
    peak = 0
    for _ in range(2):
        for layer in store.order:
            for experts in store.calls_for(list(range(cfg.moe.num_experts))):
                w1, w2 = store.cache.bring(layer, experts)
                assert float(w1[experts].sum() + w2[experts].sum()) != 0.0  # touch them: the pages a kernel reads
                peak = max(peak, _mapping_rss(views))
    assert store.cache.capacity <= peak <= store.cache.capacity + 4 * HUGE, (peak, store.cache.capacity)
    store.close()
    assert _mapping_rss(views) == 0


def test_bad_stores_fail_in_one_line_naming_the_file(tmp_path):
    from megamoe.lora import LoRAConfig, apply_lora  # noqa: F401
    from megamoe.model.language_model import LanguageModel
    from megamoe.expert_store import open_expert_store

    cfg = moe_heavy_config(hidden=32, experts=8, ffn=16)
    store_dir = write_store(cfg, tmp_path / "store")
    cfg.moe.expert_store = ExpertStoreConfig(budget_mib=1.0)
    model = LanguageModel(cfg)
    with pytest.raises(ConfigError, match="no store is open"):
        model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: missing"):
        open_expert_store([model], model.groups, tmp_path)
    shard = next(p for p in os.listdir(store_dir) if p.endswith(".safetensors"))
    path = os.path.join(store_dir, shard)
    with open(path, "r+b") as f:  # truncated: the last tensor's bytes end past the file's end
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError, match=f"{shard}: truncated") as e:
        open_expert_store([model], model.groups, store_dir)
    assert "\n" not in str(e.value)
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)
    with pytest.raises(CheckpointError, match=f"{shard}: not a valid safetensors file"):
        open_expert_store([model], model.groups, store_dir)
    os.remove(path)
    with pytest.raises(CheckpointError, match=f"{shard}: file not found"):
        open_expert_store([model], model.groups, store_dir)


def test_tiered_training_needs_lora():
    from megamoe.recipe import Recipe as TrainRecipe
    from megamoe.training.trainer import Trainer
    from megamoe.data import DataConfig
    from megamoe.training.config import TrainConfig

    cfg = moe_heavy_config(hidden=32, experts=4, ffn=16)
    cfg.moe.expert_store = ExpertStoreConfig(budget_mib=1.0)
    recipe = TrainRecipe(model=cfg, data=DataConfig(kind="synthetic", seq_len=8),
                         train=TrainConfig(steps=1, micro_batch_size=1, global_batch_size=1))
    with pytest.raises(ConfigError, match="tiered experts are frozen"):
        Trainer(recipe)


# ---- the command-line entries ----------------------------------------------------------------

def test_generate_with_an_expert_budget_gives_the_same_tokens(tmp_path, capsys):
    from megamoe.commands.generate import main

    cfg = moe_heavy_config(hidden=32, experts=8, ffn=16)
    store = write_store(cfg, tmp_path / "store")
    outs = []
    for extra in ([], ["--expert-budget", "0.02"], ["--expert-budget", "0.02", "--no-expert-map"]):
        main([store, "--ids", "1,2,3", "--max-new-tokens", "5", *extra])
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].strip()


def test_finetune_takes_the_store_settings_from_the_recipe(tmp_path):
    """The fine-tune entry adopts the checkpoint's model but keeps the run's expert_store."""
    from megamoe.training.config import CheckpointConfig
    from megamoe.training.entry import adopt_checkpoint_model
    from megamoe.recipe import Recipe as TrainRecipe
    from megamoe.data import DataConfig

    cfg = moe_heavy_config(hidden=32, experts=8, ffn=16)
    store = write_store(cfg, tmp_path / "store")
    mine = copy.deepcopy(cfg)
    mine.moe.expert_store = ExpertStoreConfig(budget_mib=3.0, tier="host")
    recipe = TrainRecipe(model=mine, data=DataConfig(kind="synthetic", seq_len=8),
                         checkpoint=CheckpointConfig(load=store))
    adopt_checkpoint_model(recipe, ["model.moe.expert_store.budget_mib=3.0"])
    assert recipe.model.moe.expert_store == ExpertStoreConfig(budget_mib=3.0, tier="host")


@pytest.mark.parametrize("mapped", [True, False])
def test_planner_counts_the_budget_instead_of_the_experts(tmp_path, mapped):
    """stage_memory: a tiered stage holds min(budget, its experts) resident; the experts' bytes
    are reported as stored. What a rank really holds (its other parameters and its experts'
    bytes: the pages mapped in, or the cache's slots and one kernel call's stacks) is that
    figure, to within one expert's bytes (the store counts whole experts)."""
    from megamoe.lora import LoRAConfig, apply_lora
    from megamoe.model.language_model import LanguageModel
    from megamoe.planning.plan import stage_memory
    from megamoe.expert_store import open_expert_store
    from megamoe.checkpoint.dcp import load_checkpoint

    cfg = moe_heavy_config(hidden=32, experts=8, ffn=16)
    store_dir = write_store(cfg, tmp_path / "store")
    lora = LoRAConfig(rank=4)  # frozen experts in both plans
    resident = stage_memory(cfg, ParallelConfig(), 1, 1, 8, lora=lora)[0]
    tiered_cfg = copy.deepcopy(cfg)
    tiered_cfg.moe.expert_store = ExpertStoreConfig(budget_mib=0.05, path=store_dir, map=mapped)
    tiered = stage_memory(tiered_cfg, ParallelConfig(), 1, 1, 8, lora=lora)[0]
    e_bytes, budget = experts_bytes(cfg), 0.05 * 2 ** 20
    assert resident["stored"] == 0 and tiered["stored"] == e_bytes
    assert tiered["weights"] == pytest.approx(resident["weights"] - e_bytes + budget)
    assert tiered["device"] == pytest.approx(resident["device"] - e_bytes + budget)

    model = LanguageModel(tiered_cfg)
    load_checkpoint(store_dir, model.groups, [model], load_rng=False)
    apply_lora(model, lora)
    store = open_expert_store([model], model.groups)
    held = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    if mapped:  # the pages mapped in, at most
        held += store.cache.capacity
    else:  # the slots and one call's stacks
        held += sum(t.numel() * t.element_size() for t in store.cache.pool) + store.per_call * store.expert_bytes
    assert store.mapped == mapped
    assert tiered["weights"] - store.expert_bytes <= held <= tiered["weights"], (held, tiered["weights"])
    store.close()
