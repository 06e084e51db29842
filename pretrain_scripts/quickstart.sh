#!/usr/bin/env bash
# Quickstart, the README's main job (about 3 minutes on a quiet 2-core CPU after set-up):
#   1. set up .venv (first run only: torch, megamoe with the hf and dev extras)
#   2. train a tiny hybrid-attention MoE vision-language model (Gated DeltaNet + gated attention,
#      8 experts top-2 + a shared expert, timm qwen3_vit tower) on procedurally drawn shapes and
#      their captions, logging to TensorBoard and saving checkpoints
#   3. export the trained model to an HF qwen3_5_moe checkpoint and check transformers loads it
#   4. caption a new image with the trained model
#
#   bash pretrain_scripts/quickstart.sh                    # defaults (megamoe/recipes/quickstart_vlm.yaml)
#   bash pretrain_scripts/quickstart.sh train.steps=100    # recipe overrides
#   OUT=outputs/other CONFIG=my_vlm.yaml bash pretrain_scripts/quickstart.sh
# A second run resumes from OUT's checkpoints; delete OUT to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source pretrain_scripts/env.sh
CONFIG="${CONFIG:-quickstart_vlm}"
OUT="${OUT:-outputs/quickstart}"

echo "[quickstart] 1/4 the model"
python tools/show_model.py --config "$CONFIG" "$@" | tail -n 3

echo "[quickstart] 2/4 training ($CONFIG, checkpoints and TensorBoard logs in $OUT)"
python tools/pretrain.py --config "$CONFIG" checkpoint.dir="$OUT" logging.dir="$OUT/tb" "$@"

echo "[quickstart] 3/4 export to Hugging Face format"
python tools/convert.py export-hf "$OUT" "$OUT/hf" --family qwen3_5_moe --overwrite
python - "$OUT/hf" <<'PY'
import sys, warnings
warnings.filterwarnings("ignore")
import transformers
from megamoe.convert.verify import load_hf_model
model = load_hf_model(sys.argv[1])
print(f"transformers {transformers.__version__} loads it as {type(model).__name__} "
      f"({sum(p.numel() for p in model.parameters()):,} parameters)")
PY

echo "[quickstart] 4/4 caption a new image"
python - "$OUT/sample.png" <<'PY'
import sys
import numpy as np
from megamoe.data.shapes import draw_sample
image, caption = draw_sample(np.random.default_rng([2026, 12]))  # not among the training images' seeds
image.save(sys.argv[1])
print(f"image {sys.argv[1]}: true caption: {caption}")
PY
printf "generated caption: "
# one short generation: compiling the fused kernels (megamoe.fusion) would cost more than it saves
MEGAMOE_FUSION=off python tools/generate.py "$OUT/hf" --image "$OUT/sample.png" --tokenizer byte --max-new-tokens 80

echo "[quickstart] done"
echo "  TensorBoard logs:   tensorboard --logdir $OUT/tb"
echo "  checkpoints:        $OUT/step_*"
echo "  HF checkpoint:      $OUT/hf"
