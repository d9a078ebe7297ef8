#!/usr/bin/env bash
# Installs the Debian packages (scripts/install-deps.sh) and builds vroll in ./build (Release with
# Ninja when the folder is new; an existing build keeps its generator and build type). VROLL_BUILD_DIR
# names another folder.
# Usage: scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD_DIR=${VROLL_BUILD_DIR:-build}
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then
  # An existing build keeps its generator and build type (a user's Debug or Makefiles build is
  # not switched to Release/Ninja, which cmake refuses or which rebuilds everything).
  cmake -S . -B "$BUILD_DIR" "$@"
else
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build "$BUILD_DIR" -j "$(nproc)"
