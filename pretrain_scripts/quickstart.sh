#!/usr/bin/env bash
# Quickstart, the README's main job (about 4 minutes on a quiet 2-core CPU after set-up):
#   1. set up .venv (first run only: torch, megamoe with the hf and dev extras)
#   2. train a tiny hybrid-attention MoE vision-language model (Gated DeltaNet + gated attention,
#      8 experts top-2 + a shared expert, timm qwen3_vit tower) on procedurally drawn shapes and
#      their captions, logging to TensorBoard and saving checkpoints
#   3. export the trained model to an HF qwen3_5_moe checkpoint
#   4. caption held-out images (seeds training never used) through that checkpoint with transformers
#      (batched greedy decoding); print the exact-match and per-field (colour, shape, place)
#      accuracy and two examples, and record the accuracy in TensorBoard and metrics.jsonl
# Each phase prints its elapsed wall time and CPU time.
#
#   bash pretrain_scripts/quickstart.sh                    # defaults (megamoe/recipes/quickstart_vlm.yaml)
#   bash pretrain_scripts/quickstart.sh train.steps=100    # recipe overrides
#   OUT=outputs/other CONFIG=my_vlm.yaml bash pretrain_scripts/quickstart.sh
#   EVAL_IMAGES=200 EVAL_SEED=7 bash pretrain_scripts/quickstart.sh   # held-out set (defaults 64, 2026)
# A second run resumes from OUT's checkpoints; delete OUT to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source pretrain_scripts/env.sh
CONFIG="${CONFIG:-quickstart_vlm}"
OUT="${OUT:-outputs/quickstart}"
EVAL_IMAGES="${EVAL_IMAGES:-64}"
EVAL_SEED="${EVAL_SEED:-2026}"

# elapsed wall time and CPU time per phase: CPU is user+sys of everything run so far, from bash's
# `times` (read in this shell: a $(...) subshell would count only itself)
TIMES_FILE=$(mktemp)
trap 'rm -f "$TIMES_FILE"' EXIT
read_clock() {
  times > "$TIMES_FILE"
  CPU=$(awk 'NR == 2 { split($1, u, /[ms]/); split($2, s, /[ms]/); printf "%.1f", u[1] * 60 + u[2] + s[1] * 60 + s[2] }' "$TIMES_FILE")
  NOW=$(date +%s.%N)
}
read_clock; START=$NOW; START_CPU=$CPU; PHASE=$NOW; PHASE_CPU=$CPU
phase_done() {
  read_clock
  awk -v a="$PHASE" -v b="$NOW" -v x="$PHASE_CPU" -v y="$CPU" 'BEGIN { printf "[quickstart]     took %.1f s (CPU %.1f s)\n", b - a, y - x }'
  PHASE=$NOW; PHASE_CPU=$CPU
}

echo "[quickstart] 1/4 the model"
python tools/show_model.py --config "$CONFIG" "$@" | tail -n 3
phase_done

echo "[quickstart] 2/4 training ($CONFIG, checkpoints and TensorBoard logs in $OUT)"
python tools/pretrain.py --config "$CONFIG" checkpoint.dir="$OUT" logging.dir="$OUT/tb" "$@"
phase_done

echo "[quickstart] 3/4 export to Hugging Face format"
python tools/convert.py export-hf "$OUT" "${OUT}_hf" --family qwen3_5_moe --overwrite
phase_done
echo "[quickstart] 4/4 caption $EVAL_IMAGES new images (seed $EVAL_SEED, never used in training) with transformers"
MEGAMOE_FUSION=off python tools/captions.py "${OUT}_hf" --log-dir "$OUT/tb" --images "$EVAL_IMAGES" --seed "$EVAL_SEED"
phase_done
read_clock
awk -v a="$START" -v b="$NOW" -v x="$START_CPU" -v y="$CPU" \
  'BEGIN { printf "[quickstart] done in %.1f s, CPU %.1f s user+sys (set-up excluded)\n", b - a, y - x }'
# the machine's speed, to compare times with docs/training.md's (measured after the run: it is not slowed)
python - <<'PY'
import time, torch
a = torch.randn(1024, 1024)
a @ a
start, n = time.perf_counter(), 0
while time.perf_counter() - start < 0.5:
    a @ a
    n += 1
rate = 2 * 1024**3 * n / (time.perf_counter() - start) / 1e9
print(f"  this machine:       fp32 matmul {rate:.0f} GFLOP/s on {torch.get_num_threads()} threads (docs/training.md)")
PY
echo "  TensorBoard logs:   tensorboard --logdir $OUT/tb"
echo "  checkpoints:        $OUT/step_*"
echo "  HF checkpoint:      ${OUT}_hf"
