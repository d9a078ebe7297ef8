#!/usr/bin/env bash
# README command (1): set up, build, and run the main job: GRPO training of a Llama policy whose
# rollouts come from vroll workers over ZeroMQ. Starts the worker(s), trains for a few minutes
# (VROLL_DEMO_MINUTES, default 3), and prints where the reward / logprob-gap plots and the JSONL
# log are. Uses stories260K from ../shared/models when present, else the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${VROLL_BUILD_DIR:-build}
MODELS=${VROLL_MODELS:-../shared/models}
MINUTES=${VROLL_DEMO_MINUTES:-3}
OUT=${VROLL_DEMO_OUT:-out/grpo}
ARGS=(--worker-bin "$BUILD_DIR/examples/vroll-worker" --minutes "$MINUTES" --out "$OUT")
if [ -f "$MODELS/stories260K.bin" ] && [ -f "$MODELS/tok512.bin" ]; then
  ARGS+=(--model "$MODELS/stories260K.bin" --tokenizer "$MODELS/tok512.bin")
else
  missing=""
  for f in stories260K.bin tok512.bin; do [ -f "$MODELS/$f" ] || missing="$missing $MODELS/$f"; done
  if [ -n "${VROLL_MODELS:-}" ]; then
    # Asked for explicitly: a missing file is an error, not a silent switch of model.
    echo "demo: error: VROLL_MODELS=$VROLL_MODELS lacks$missing (relative paths are from the repository root, $(pwd))" >&2
    exit 2
  fi
  echo "demo:$missing not found; training the embedded default model instead" >&2
fi
bash scripts/build.sh >&2
exec /usr/bin/python3 examples/python/grpo_trainer.py "${ARGS[@]}" "$@"
