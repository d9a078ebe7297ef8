#!/usr/bin/env bash
# Installs every Debian 12 package vroll needs to build, test and run its examples.
# Idempotent: packages already present are skipped; safe to run again. Needs root (or sudo).
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config ninja-build
  libtorch-dev libopenblas0-openmp
  libzmq3-dev cppzmq-dev
  libmsgpack-cxx-dev
  libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev
  libxxhash-dev
  nlohmann-json3-dev
  libcli11-dev
  python3-torch python3-zmq python3-msgpack python3-numpy python3-matplotlib python3-xxhash
  python3-pip python3-setuptools
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo > /dev/null; then
    echo "install-deps: error: not root and no sudo; as root, run: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  SUDO="sudo"
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
