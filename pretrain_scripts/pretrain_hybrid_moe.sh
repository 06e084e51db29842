#!/usr/bin/env bash
# Pretrain a hybrid-attention MoE with torchrun on one node (for many nodes see slurm_pretrain.sbatch).
#
#   bash pretrain_scripts/pretrain_hybrid_moe.sh                          # the tiny CPU recipe (tiny_hybrid_moe)
#   NGPU=2 EP=2 bash pretrain_scripts/pretrain_hybrid_moe.sh              # expert parallel over 2 ranks
#   NGPU=4 TP=2 PP=2 SP=1 bash pretrain_scripts/pretrain_hybrid_moe.sh train.steps=500
#   NGPU=2 CP=2 bash pretrain_scripts/pretrain_hybrid_moe.sh data.seq_len=4096     # context parallel
#   CONFIG=my_recipe.yaml NGPU=8 TP=2 EP=4 bash pretrain_scripts/pretrain_hybrid_moe.sh
#   DATA=data/corpus.tokens RESET_AT_EOS=1 EOS_MASK_LOSS=1 bash pretrain_scripts/pretrain_hybrid_moe.sh  # token files, documents apart
#   DRY_RUN=1 NGPU=8 NNODES=128 TP=8 PP=4 EP=32 CONFIG=moe_1t bash pretrain_scripts/pretrain_hybrid_moe.sh
#
# Knobs: see pretrain_scripts/launch.sh. Extra arguments are recipe overrides (key=value).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source pretrain_scripts/env.sh
# shellcheck disable=SC1091
source pretrain_scripts/launch.sh
CONFIG="${CONFIG:-tiny_hybrid_moe}"
run_torchrun tools/pretrain.py "$CONFIG" "${PRETRAIN_DATA_OVERRIDES[@]}" "$@"
