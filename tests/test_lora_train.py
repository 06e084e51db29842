"""LoRA through the trainer (2 data-parallel ranks): routing provably undisturbed, and a fine-tune of
a tiny converted model with the shipped recipe (tools/finetune.py's path) that lowers the loss,
prints the trainable count, writes adapter-only checkpoints, resumes exactly from them and
exports a PEFT adapter that transformers + peft run with the same logits."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from megamoe.core.config import AttentionConfig, ModelConfig, MoEConfig, ParallelConfig

# ---- routing ------------------------------------------------------------------------------


def _assignments(model, ids) -> list[torch.Tensor]:
    """Expert indices [T, k] every router picks for ``ids`` (eval forward)."""
    from megamoe.model.moe_controls import routers

    picked = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: picked.append(out.idx.clone())) for r in routers(model)]
    model.eval()
    with torch.no_grad():
        model(ids)
    model.train()
    for h in hooks:
        h.remove()
    return picked


def routing_case(update_expert_bias: bool, log_dir: str) -> dict:
    """50 LoRA steps on a one-layer MoE whose router input no adapter touches (the layer's own
    experts and shared expert are adapted): the routing can only change through the router."""
    from megamoe.data import DataConfig
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.lora import LoRAConfig
    from megamoe.training.config import LoggingConfig, OptimConfig, TrainConfig
    from megamoe.recipe import Recipe as TrainRecipe
    from megamoe.training.trainer import Trainer

    model = ModelConfig(vocab_size=64, hidden_size=32, layout="Ae",
                        attention=AttentionConfig(num_heads=4, num_kv_heads=2),
                        moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=32, num_shared_experts=1,
                                      expert_bias=True, expert_bias_update_rate=1e-2, aux_loss_coeff=1e-2))
    recipe = TrainRecipe(model=model, parallel=ParallelConfig(), data=DataConfig(kind="synthetic", seq_len=16),
                         train=TrainConfig(steps=50, micro_batch_size=2, global_batch_size=4, seed=3),
                         optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.0),
                         logging=LoggingConfig(progress=False, latency_interval=0),
                         lora=LoRAConfig(rank=4, targets=["mlp"], update_expert_bias=update_expert_bias))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=5))
    chunk = trainer.chunks[0]
    router = chunk.layers["0"].mlp.router
    fixed = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(9))
    before = _assignments(chunk, fixed)
    bias, weight = router.expert_bias.detach().clone(), router.weight.detach().clone()
    adapter = chunk.layers["0"].mlp.experts.down_lora_B.detach().clone()
    # after every step, not only the last: a sign-driven bias can come back to where it started
    seen = {"bias": True, "routing": True}

    def watch(t):
        seen["bias"] &= torch.equal(bias, router.expert_bias)
        seen["routing"] &= all(torch.equal(a, b) for a, b in zip(before, _assignments(chunk, fixed)))

    trainer.after_step_hooks.append(watch)
    history = trainer.fit(log_dir)
    return {"same_assignments": seen["routing"],
            "bias_bitwise_same": seen["bias"], "weight_bitwise_same": torch.equal(weight, router.weight),
            "adapters_trained": not torch.equal(adapter, chunk.layers["0"].mlp.experts.down_lora_B),
            "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"], "steps": len(history)}


def test_lora_leaves_routing_undisturbed(pool, tmp_path):
    frozen, control = (pool(2).run(routing_case, flag, str(tmp_path / str(flag))) for flag in (False, True))
    for r in frozen:
        assert r["steps"] == 50 and r["adapters_trained"] and r["last_loss"] < r["first_loss"]
        assert r["same_assignments"] and r["bias_bitwise_same"] and r["weight_bitwise_same"]
    # opting in to the bias update does move the bias and the routing: the check above can fail
    assert not control[0]["bias_bitwise_same"] and not control[0]["same_assignments"]
    assert control[0]["weight_bitwise_same"]


# ---- fine-tune a converted model ------------------------------------------------------------

def finetune_case(base: str, chat: str, run_dir: str, steps: int, extra: list[str]) -> dict:
    from megamoe.recipe import load_train_recipe
    from megamoe.training.entry import run_training

    overrides = [f"data.paths=[{chat}]", f"checkpoint.dir={run_dir}", f"logging.dir={run_dir}/tb",
                 f"train.steps={steps}", "logging.interval=1", "logging.progress=false",
                 "logging.latency_interval=0", *extra]
    if base:
        overrides.append(f"checkpoint.load={base}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = run_training(load_train_recipe("tiny_moe_lora", overrides))
    return {"printed": out.getvalue(), "step": summary["steps"]}


def logged_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "tb" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def write_chats(path: Path, n: int = 24) -> Path:
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def tiny_converted_model(root: Path) -> tuple[Path, Path]:
    """An HF Qwen3-MoE with random weights shaped like the recipe's model, and its import."""
    import transformers

    from megamoe.convert import import_hf
    from megamoe.convert.family import get_family
    from megamoe.recipe import load_recipe

    cfg = load_recipe("tiny_moe_lora").model
    hf_cfg = get_family("qwen3_moe").config_to_hf(cfg, None)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf_cfg))
    hf.save_pretrained(root / "hf")
    return root / "hf", import_hf(root / "hf", root / "base", progress=False)


def peft_logits_match(hf_dir: Path, base: Path, ckpt: Path, out: Path) -> tuple[float, float]:
    """(max |megamoe - transformers+peft| logits, max |adapted - base| logits) for a LoRA checkpoint."""
    from peft import PeftModel

    from megamoe.diagnostics.verify import load_hf_model
    from megamoe.convert import export_peft_checkpoint
    from megamoe.lora import apply_lora, is_adapter_name
    from megamoe.core.config_io import config_from_dict
    from megamoe.lora.config import LoRAConfig
    from megamoe.checkpoint.dcp import load_checkpoint, read_meta
    from tests.conversion_harness import load_converted

    export_peft_checkpoint(ckpt, out)
    meta = read_meta(ckpt)
    model = apply_lora(load_converted(base), config_from_dict(meta["lora"], LoRAConfig))
    load_checkpoint(ckpt, model.groups, [model], load_rng=False, select=is_adapter_name)
    hf = load_hf_model(hf_dir)
    ids = torch.randint(0, 262, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = hf(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(hf, str(out)).eval()(input_ids=ids).logits
        ours = model.eval()(ids)
    return (ours - peft_logits).abs().max().item(), (ours - base_logits).abs().max().item()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_lora_finetune_converted_model_resume_and_peft(pool, tmp_path):
    from megamoe.checkpoint.dcp import SafeFileSystemReader

    hf_dir, base = tiny_converted_model(tmp_path)
    chat = write_chats(tmp_path / "chat.jsonl")
    full = tmp_path / "full"
    runs = pool(2).run(finetune_case, str(base), str(chat), str(full), 12,
                       ["checkpoint.save_interval=6", "checkpoint.keep_last=3"])
    r = runs[0]
    assert "LoRA:" in r["printed"] and "trainable parameters of" in r["printed"]
    trainable = int(r["printed"].split("LoRA: ")[1].split(" trainable")[0].replace(",", ""))
    assert 0 < trainable < 0.2 * int(r["printed"].split(" of ")[1].split(" (")[0].replace(",", ""))
    losses = logged_losses(full)
    assert r["step"] == 12 and len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses

    # adapter-only checkpoints: every model tensor stored is a LoRA factor
    step6 = full / "step_00000006"
    keys = SafeFileSystemReader(str(step6)).read_metadata().state_dict_metadata
    model_keys = {k.split("/", 1)[1].split("#")[0] for k in keys if k.startswith("model/")}
    assert model_keys and all("lora_" in k for k in model_keys)

    # resume from step 6 without checkpoint.load (the base is recorded in the checkpoint)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(step6, resumed / step6.name)
    again = pool(2).run(finetune_case, "", str(chat), str(resumed), 12, [])[0]
    continued = logged_losses(resumed)
    assert again["step"] == 12 and len(continued) == 6
    assert max(abs(a - b) for a, b in zip(continued, losses[6:])) <= 1e-6, (continued, losses[6:])

    mismatch, effect = peft_logits_match(hf_dir, base, full / "step_00000012", tmp_path / "peft")
    assert mismatch <= 1e-4 and effect > 1e-3, (mismatch, effect)


# ---- layouts through the trainer ------------------------------------------------------------

def layout_curve(parallel: dict, log_dir: str) -> list[float]:
    """6 LoRA steps of the trainer-parity model (G, A, S mixers, MoE with shared expert and bias)."""
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.lora import LoRAConfig
    from megamoe.training.trainer import Trainer
    from tests.test_trainer_parity import tiny_recipe

    recipe = tiny_recipe(ParallelConfig(**parallel), steps=6)
    recipe.lora, recipe.optim.lr, recipe.optim.warmup_steps = LoRAConfig(rank=4, alpha=8.0), 1e-2, 1
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(recipe, SyntheticDataset(64, 16, seed=3))
    return [h["loss"] for h in trainer.fit(log_dir)]


def test_lora_training_layouts_agree(pool, tmp_path):
    """DP=2 (== one process, tests/test_trainer_parity.py), PP=2 and TP=2 with SP give the same
    LoRA loss curve: adapters through the pipeline schedule and the trainer's gradient sync."""
    curves = {name: pool(2).run(layout_curve, parallel, str(tmp_path / name))[0]
              for name, parallel in (("dp2", {}), ("pp2", dict(pp=2)),
                                     ("tp2-sp", dict(tp=2, sequence_parallel=True)))}
    for name, curve in curves.items():
        assert len(curve) == 6 and max(abs(a - b) for a, b in zip(curve, curves["dp2"])) <= 1e-5, (name, curve)
    assert curves["dp2"][-1] < curves["dp2"][0]


def long_context_curve(parallel: dict, log_dir: str) -> list[float]:
    """6 LoRA steps of the trainer-parity model on 64-token sequences, adapters on every role
    (every mixer projection, dense and shared-expert MLPs, the routed experts), the whole layer
    recomputed in backward (so the CP ring and state exchange run again inside it)."""
    from megamoe.data.synthetic import SyntheticDataset
    from megamoe.lora import LoRAConfig
    from megamoe.training.trainer import Trainer
    from tests.test_trainer_parity import tiny_recipe

    recipe = tiny_recipe(ParallelConfig(**parallel), steps=6, recompute=["layer", "core"])
    recipe.data.seq_len = 64
    recipe.lora, recipe.optim.lr, recipe.optim.warmup_steps = LoRAConfig(rank=4, alpha=8.0, targets=["*"]), 1e-2, 1
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(recipe, SyntheticDataset(64, 64, seed=3))
    return [h["loss"] for h in trainer.fit(log_dir)]


def test_lora_cp2_tp2_recompute_follows_one_process(pool, tmp_path):
    """Long-context fine-tuning's layout: CP=2 x TP=2 with SP, LoRA on every role, recompute on,
    gives one process's loss curve within 1e-5 (G's state passing, A's ring, S's halo)."""
    one = pool(1).run(long_context_curve, {}, str(tmp_path / "one"))[0]
    par = pool(4).run(long_context_curve, dict(cp=2, tp=2, sequence_parallel=True), str(tmp_path / "cp2tp2"))
    assert all(curve == par[0] for curve in par)  # every rank logs the same global loss
    assert len(one) == 6 and max(abs(a - b) for a, b in zip(par[0], one)) <= 1e-5, (par[0], one)
    assert one[-1] < one[0]
