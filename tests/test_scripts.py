"""The shell scripts as users run them: the LoRA fine-tune as a real two-process torchrun (with
validation through the EVAL_* knobs), and the Slurm templates with DRY_RUN=1 (no scheduler
here: the plan and the torchrun command each node would run). pretrain_hybrid_moe.sh runs in
tests/test_cp_train.py and tests/test_pretrain_pack.py, quickstart.sh in tests/test_quickstart.py;
env.sh and launch.sh are sourced by all of them."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.dist import script_env

REPO = Path(__file__).resolve().parent.parent
CHATS = [[{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": str(a + b)}]
         for a in range(6) for b in range(4)]


def run_script(script: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(["bash", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{script} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def test_finetune_lora_script_trains_two_processes_with_validation(tmp_path):
    """``BASE=... DATA=chat.jsonl NGPU=2 EP=2 EVAL_SPLIT=0.25 ... bash finetune_lora.sh``: adapters
    on a converted tiny Qwen3-MoE over two ranks, the held-out quarter evaluated every step, an
    adapter-only checkpoint; the LoRA knobs reach the recipe."""
    from tests.test_lora_train import tiny_converted_model

    _, base = tiny_converted_model(tmp_path)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    env = script_env(tmp_path, NGPU="2", EP="2", BASE=str(base), DATA=str(chat), LORA_RANK="4", LORA_ALPHA="8",
                     EVAL_SPLIT="0.25", EVAL_INTERVAL="1", EVAL_ITERS="1")
    out = run_script("pretrain_scripts/finetune_lora.sh", env, "train.steps=2", "train.global_batch_size=4",
                     "train.micro_batch_size=2", f"checkpoint.dir={tmp_path / 'run'}", f"logging.dir={tmp_path / 'tb'}",
                     "logging.progress=false", "logging.latency_interval=0")
    assert (f"parallel.ep=2 eval.split=0.25 eval.interval=1 eval.iters=1 checkpoint.load={base} data.kind=sft "
            f"data.paths=[{chat}] lora.rank=4 lora.alpha=8" in out.stdout), out.stdout
    lines = [json.loads(x) for x in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(0 < x["eval_loss"] < 10 for x in lines), lines
    assert "LoRA: " in out.stdout and ", validation loss " in out.stdout
    meta = json.loads((tmp_path / "run" / "step_00000002" / "meta.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["lora_base"] == str(base.resolve())


def test_slurm_templates_dry_run(tmp_path):
    """Both Slurm templates plan and print the per-node torchrun command without a scheduler:
    c10d rendezvous at MASTER_ADDR, the knobs as overrides (data blend, fine-tuning, validation,
    W&B, indexer training)."""
    env = script_env(tmp_path, DRY_RUN="1", CONFIG="moe_1t", NNODES="128", NGPU="8", TP="8", PP="4", EP="32",
                     DATA="0.3,/data/web_text_document,0.7,/data/code.tokens", EVAL_SPLIT="0.005",
                     EVAL_INTERVAL="500", WANDB_PROJECT="pretrain", MASTER_ADDR="node001")
    out = run_script("pretrain_scripts/slurm_pretrain.sbatch", env, "train.steps=10000").stdout
    assert ("command: torchrun --nnodes 128 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node001:29500 "
            "--rdzv-id megamoe --max-restarts 0 tools/pretrain.py --config moe_1t parallel.tp=8 parallel.pp=4 "
            "parallel.ep=32 eval.split=0.005 eval.interval=500 logging.wandb.project=pretrain data.kind=pretrain "
            "data.paths=[0.3,/data/web_text_document,0.7,/data/code.tokens] train.steps=10000") in out, out
    assert "1.03T" in out  # the plan's parameter budget
    env = script_env(tmp_path, DRY_RUN="1", CONFIG="tiny_mla_dsa", INDEXER="warmup", NGPU="1")
    out = run_script("pretrain_scripts/slurm_pretrain.sbatch", env).stdout
    assert "tools/pretrain.py --config tiny_mla_dsa train.indexer.mode=warmup" in out, out
    env = script_env(tmp_path, DRY_RUN="1", CONFIG="tiny_moe_lora", NNODES="2", NGPU="2", EP="2", BASE="/ckpt/base",
                     DATA="/data/chat.jsonl", LORA_RANK="16", EVAL_DATA="/data/held_out.jsonl", EVAL_SAVE_BEST="1")
    env.pop("MASTER_ADDR", None)
    out = run_script("pretrain_scripts/slurm_finetune.sbatch", env, "train.micro_batch_size=2").stdout
    assert ("command: torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 "
            "--rdzv-id megamoe --max-restarts 0 tools/finetune.py --config tiny_moe_lora parallel.ep=2 "
            "eval.paths=[/data/held_out.jsonl] eval.save_best=true checkpoint.load=/ckpt/base "
            "data.kind=sft data.paths=[/data/chat.jsonl] lora.rank=16 train.micro_batch_size=2") in out, out
