#!/usr/bin/env bash
# Set-up, configure, build, then run every test that needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
cd build
ctest --output-on-failure -j "$(nproc)" -LE gpu --timeout 900
