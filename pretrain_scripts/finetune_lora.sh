#!/usr/bin/env bash
# LoRA fine-tune of converted weights with torchrun on one node: adapters on every linear and
# expert, backbone and router frozen, adapter-only checkpoints (docs/lora.md). For many nodes see
# slurm_finetune.sbatch.
#
#   python tools/convert.py import-hf HF_DIR ckpt/base                         # once: the weights to adapt
#   BASE=ckpt/base DATA=chat.jsonl bash pretrain_scripts/finetune_lora.sh      # the tiny recipe on CPU
#   NGPU=8 EP=8 BASE=ckpt/qwen3_moe DATA=a.jsonl,b.jsonl CONFIG=my_lora.yaml \
#       LORA_RANK=16 LORA_ALPHA=32 bash pretrain_scripts/finetune_lora.sh train.steps=2000
#   LORA_TARGETS='[experts,shared_experts]' EXPERT_ADAPTERS=shared ...          # only the MLPs, one expert adapter
#   EVAL_DATA=held_out.jsonl EVAL_INTERVAL=100 EVAL_SAVE_BEST=1 ...             # validation, best checkpoint kept
#   DRY_RUN=1 NGPU=8 TP=2 EP=4 BASE=ckpt/base DATA=chat.jsonl bash pretrain_scripts/finetune_lora.sh train.global_batch_size=16
# then: python tools/convert.py export-peft outputs/tiny_moe_lora/step_XXXXXXXX peft_out
#
# Knobs (besides pretrain_scripts/launch.sh's NGPU, NNODES, TP, PP, EP, ETP, SP, DRY_RUN, EVAL_*,
# WANDB_*, and its fine-tuning knobs BASE, LORA_RANK, LORA_ALPHA, LORA_TARGETS, EXPERT_ADAPTERS,
# UPDATE_EXPERT_BIAS):
#   CONFIG            recipe with a lora section (default tiny_moe_lora)
#   DATA              SFT JSONL file(s), comma-separated (data.paths; the same as SFT_DATA)
# Extra arguments are recipe overrides (key=value).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source pretrain_scripts/env.sh
SFT_DATA="${SFT_DATA:-${DATA:-}}"; DATA=""  # here DATA names chat files, not pretraining token files
# shellcheck disable=SC1091
source pretrain_scripts/launch.sh
CONFIG="${CONFIG:-tiny_moe_lora}"
run_torchrun tools/finetune.py "$CONFIG" "${FINETUNE_OVERRIDES[@]}" "$@"
