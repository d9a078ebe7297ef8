#!/usr/bin/env bash
# README command (2): set up, build and run every test (ctest). CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
BUILD_DIR=${VROLL_BUILD_DIR:-build}
# Tests run one at a time: each LibTorch test uses every core itself.
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 900 "$@"
