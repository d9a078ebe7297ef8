#!/usr/bin/env bash
# README command (1): set up, build and run the main job.
# Today: text generation with the policy model (stories260K from ../shared when present, else the
# embedded default model). The GRPO rollout demo replaces this when the worker lands.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >&2
BUILD_DIR=${VROLL_BUILD_DIR:-build}
MODELS=${VROLL_MODELS:-../shared/models}
if [ -f "$MODELS/stories260K.bin" ] && [ -f "$MODELS/tok512.bin" ]; then
  exec "$BUILD_DIR/examples/vroll-generate" --model "$MODELS/stories260K.bin" --tokenizer "$MODELS/tok512.bin" \
    --prompt "Once upon a time" --temperature 0.8 --max-new-tokens 200 "$@"
else
  echo "demo: $MODELS/stories260K.bin not found; using the embedded default model" >&2
  exec "$BUILD_DIR/examples/vroll-generate" --max-new-tokens 100 "$@"
fi
