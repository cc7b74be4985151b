#!/usr/bin/env bash
# Configures and builds into build/ (binaries in build/bin/). Extra args go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "$@" >/dev/null
cmake --build build -j "$jobs"
