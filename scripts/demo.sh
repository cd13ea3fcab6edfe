#!/usr/bin/env bash
# Sets up a fresh machine, builds shardpoint and runs the main job: `shardpoint demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
./build/tools/shardpoint demo "$@"
