# Sourced by the training scripts: turns env knobs into torchrun arguments and recipe overrides.
#   NGPU     processes per node (default 1)       NNODES     nodes (default 1)
#   MASTER_ADDR, MASTER_PORT                       c10d rendezvous endpoint (one node without
#                                                  MASTER_ADDR: torchrun --standalone, a free port)
#   RDZV_ID  job id the nodes meet under (default: $SLURM_JOB_ID, else megamoe)
#   MAX_RESTARTS  restarts of the worker group after a rank dies (default 0); each restart
#                 resumes from the latest complete checkpoint (checkpoint.resume=true)
#   TP PP VPP CP EP ETP                            parallel degrees (unset: the recipe's)
#   SP=1                                           sequence parallelism
#   DRY_RUN=1                                      print the plan and the command, run nothing
# Pretraining data (pretrain_hybrid_moe.sh, slurm_pretrain.sbatch; unset: the recipe's):
#   DATA           token directories (tools/prepare_data.py), comma-separated: data.kind=pretrain, data.paths
#   TOKENIZER      data.tokenizer (the one the token directories were written with)
#   RESET_AT_EOS=1 documents kept apart: positions restart and no mixer looks across an EOS
#                  (data.reset_at_eos; Megatron's --reset-position-ids --reset-attention-mask)
#   EOS_MASK_LOSS=1  no loss where the input token is EOS (data.eos_mask_loss; Megatron's --eod-mask-loss)
#   DATA also takes Megatron indexed datasets (the PREFIX of PREFIX.bin + .idx) and weights in
#   Megatron's form: DATA=0.3,/data/web,0.7,/data/code (docs/data.md)
# Fine-tuning (finetune_lora.sh, slurm_finetune.sbatch):
#   BASE           weights to start from (checkpoint.load); may be omitted when resuming
#   SFT_DATA       chat JSONL file(s), comma-separated: data.kind=sft, data.paths
#   LORA_RANK LORA_ALPHA LORA_TARGETS EXPERT_ADAPTERS   lora.rank / alpha / targets / expert_adapters
#   UPDATE_EXPERT_BIAS=1                                opt in to the expert-bias update (routing moves)
# Every run (unset: the recipe's; docs/training.md):
#   EVAL_DATA      validation files, comma-separated (eval.paths), or EVAL_SPLIT=0.01 (eval.split)
#   EVAL_INTERVAL EVAL_ITERS  eval.interval / eval.iters       EVAL_SAVE_BEST=1  eval.save_best
#   WANDB_PROJECT  log to Weights & Biases too (logging.wandb.project); WANDB_MODE=offline
#   INDEXER        train the D/I layers' indexer: warmup | sparse (train.indexer.mode)
NGPU="${NGPU:-1}"; NNODES="${NNODES:-1}"; MAX_RESTARTS="${MAX_RESTARTS:-0}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-megamoe}}"
if [ "$NNODES" = 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  RDZV=(--standalone)
else
  RDZV=(--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" --rdzv-id "$RDZV_ID")
fi
WORLD_SIZE=$((NGPU * NNODES))
PARALLEL_OVERRIDES=()
for knob in tp:TP pp:PP vpp:VPP cp:CP ep:EP etp:ETP; do
  key="${knob%%:*}"; var="${knob##*:}"
  if [ -n "${!var:-}" ]; then PARALLEL_OVERRIDES+=("parallel.$key=${!var}"); fi
done
if [ -n "${SP:-}" ]; then PARALLEL_OVERRIDES+=("parallel.sequence_parallel=$([ "$SP" = 1 ] && echo true || echo false)"); fi
PRETRAIN_DATA_OVERRIDES=()
if [ -n "${DATA:-}" ]; then PRETRAIN_DATA_OVERRIDES+=("data.kind=pretrain" "data.paths=[$DATA]"); fi
if [ -n "${TOKENIZER:-}" ]; then PRETRAIN_DATA_OVERRIDES+=("data.tokenizer=$TOKENIZER"); fi
for knob in reset_at_eos:RESET_AT_EOS eos_mask_loss:EOS_MASK_LOSS; do
  key="${knob%%:*}"; var="${knob##*:}"
  if [ -n "${!var:-}" ]; then PRETRAIN_DATA_OVERRIDES+=("data.$key=$([ "${!var}" = 1 ] && echo true || echo false)"); fi
done
FINETUNE_OVERRIDES=()
[ -n "${BASE:-}" ] && FINETUNE_OVERRIDES+=("checkpoint.load=$BASE")
[ -n "${SFT_DATA:-}" ] && FINETUNE_OVERRIDES+=("data.kind=sft" "data.paths=[$SFT_DATA]")
for knob in rank:LORA_RANK alpha:LORA_ALPHA targets:LORA_TARGETS expert_adapters:EXPERT_ADAPTERS; do
  key="${knob%%:*}"; var="${knob##*:}"
  if [ -n "${!var:-}" ]; then FINETUNE_OVERRIDES+=("lora.$key=${!var}"); fi
done
if [ -n "${UPDATE_EXPERT_BIAS:-}" ]; then
  FINETUNE_OVERRIDES+=("lora.update_expert_bias=$([ "$UPDATE_EXPERT_BIAS" = 1 ] && echo true || echo false)")
fi
RUN_OVERRIDES=()
[ -n "${EVAL_DATA:-}" ] && RUN_OVERRIDES+=("eval.paths=[$EVAL_DATA]")
for knob in split:EVAL_SPLIT interval:EVAL_INTERVAL iters:EVAL_ITERS; do
  key="${knob%%:*}"; var="${knob##*:}"
  if [ -n "${!var:-}" ]; then RUN_OVERRIDES+=("eval.$key=${!var}"); fi
done
if [ -n "${EVAL_SAVE_BEST:-}" ]; then
  RUN_OVERRIDES+=("eval.save_best=$([ "$EVAL_SAVE_BEST" = 1 ] && echo true || echo false)")
fi
[ -n "${WANDB_PROJECT:-}" ] && RUN_OVERRIDES+=("logging.wandb.project=$WANDB_PROJECT")
[ -n "${WANDB_MODE:-}" ] && RUN_OVERRIDES+=("logging.wandb.mode=$WANDB_MODE")
[ -n "${INDEXER:-}" ] && RUN_OVERRIDES+=("train.indexer.mode=$INDEXER")

# run_torchrun TOOL CONFIG [key=value ...]: plan (DRY_RUN=1) or launch on this node
run_torchrun() {
  local tool="$1" config="$2"; shift 2
  local cmd=(torchrun --nnodes "$NNODES" --nproc-per-node "$NGPU" "${RDZV[@]}" --max-restarts "$MAX_RESTARTS"
             "$tool" --config "$config" "${PARALLEL_OVERRIDES[@]}" "${RUN_OVERRIDES[@]}" "$@")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    python tools/plan.py --config "$config" --world-size "$WORLD_SIZE" "${PARALLEL_OVERRIDES[@]}" "${RUN_OVERRIDES[@]}" "$@"
    echo "command: ${cmd[*]}"
    return 0
  fi
  echo "[launch] ${cmd[*]}"
  "${cmd[@]}"
}
