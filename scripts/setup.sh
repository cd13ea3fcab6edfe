#!/usr/bin/env bash
# Installs what shardpoint needs to build and test on Debian 12, then configures and builds it.
# Usage: scripts/setup.sh [BUILD_DIR [CMAKE_ARG...]]   (default: build; the arguments after it go
# to the configure step, e.g. -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=...)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build}"

APT_PACKAGES=(g++ cmake ninja-build pkg-config libgtest-dev libgmock-dev libisal-dev libzstd-dev
              clang libclang-rt-dev openmpi-bin libopenmpi-dev python3-venv python3-dev
              libcurl4-openssl-dev openssl)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "== installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

echo "== configuring and building in $BUILD_DIR"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${@:2}" >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
