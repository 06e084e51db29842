#!/usr/bin/env bash
# LoRA fine-tune of converted weights with torchrun on one node: adapters on every linear and
# expert, backbone and router frozen, adapter-only checkpoints (docs/lora.md).
#
#   python tools/convert.py import-hf HF_DIR ckpt/base                         # once: the weights to adapt
#   BASE=ckpt/base DATA=chat.jsonl bash pretrain_scripts/finetune_lora.sh      # the tiny recipe on CPU
#   NGPU=8 EP=8 BASE=ckpt/qwen3_moe DATA=a.jsonl,b.jsonl CONFIG=my_lora.yaml \
#       LORA_RANK=16 LORA_ALPHA=32 bash pretrain_scripts/finetune_lora.sh train.steps=2000
#   LORA_TARGETS='[experts,shared_experts]' EXPERT_ADAPTERS=shared ...          # only the MLPs, one expert adapter
#   DRY_RUN=1 NGPU=8 TP=2 EP=4 BASE=ckpt/base DATA=chat.jsonl bash pretrain_scripts/finetune_lora.sh train.global_batch_size=16
# then: python tools/convert.py export-peft outputs/tiny_moe_lora/step_XXXXXXXX peft_out
#
# Knobs (besides pretrain_scripts/launch.sh's NGPU, NNODES, TP, PP, EP, ETP, SP, DRY_RUN):
#   CONFIG            recipe with a lora section (default tiny_moe_lora)
#   BASE              converted checkpoint to adapt (checkpoint.load); may be omitted when resuming
#   DATA              SFT JSONL file(s), comma-separated (data.paths)
#   LORA_RANK LORA_ALPHA LORA_TARGETS EXPERT_ADAPTERS   lora.rank / alpha / targets / expert_adapters
#   UPDATE_EXPERT_BIAS=1                                opt in to the expert-bias update (routing moves)
# Extra arguments are recipe overrides (key=value).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source pretrain_scripts/env.sh
# shellcheck disable=SC1091
source pretrain_scripts/launch.sh
CONFIG="${CONFIG:-tiny_moe_lora}"
LORA_OVERRIDES=()
[ -n "${BASE:-}" ] && LORA_OVERRIDES+=("checkpoint.load=$BASE")
[ -n "${DATA:-}" ] && LORA_OVERRIDES+=("data.paths=[$DATA]")
for knob in rank:LORA_RANK alpha:LORA_ALPHA targets:LORA_TARGETS expert_adapters:EXPERT_ADAPTERS; do
  key="${knob%%:*}"; var="${knob##*:}"
  if [ -n "${!var:-}" ]; then LORA_OVERRIDES+=("lora.$key=${!var}"); fi
done
if [ -n "${UPDATE_EXPERT_BIAS:-}" ]; then
  LORA_OVERRIDES+=("lora.update_expert_bias=$([ "$UPDATE_EXPERT_BIAS" = 1 ] && echo true || echo false)")
fi
run_torchrun tools/finetune.py "$CONFIG" "${LORA_OVERRIDES[@]}" "$@"
