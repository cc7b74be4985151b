#!/usr/bin/env bash
# Set-up, build, then the main job: generate text from the embedded default model.
# (Once the gRPC service lands this starts the server and generates through the client.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
MODEL=${MODEL:-models/subspace-tiny.gguf}
PROMPT=${PROMPT:-"And God said unto Moses,"}
echo "== subspace-run on $MODEL (greedy)"
build/bin/subspace-run --model "$MODEL" --prompt "$PROMPT" -n 48
echo "== sampled: temperature 0.8, top-p 0.95, seed 7"
build/bin/subspace-run --model "$MODEL" --prompt "Blessed are they that" -n 48 \
  --temperature 0.8 --top-p 0.95 --seed 7
