#!/usr/bin/env bash
# Served throughput, Subspace next to llama.cpp's llama-server on the same GGUF, one server at a
# time on this machine, driven by one client for both (bench/serve_compare.py: same prompts,
# greedy, fixed output length, the same concurrency). Subspace is measured over gRPC and over its
# OpenAI-compatible HTTP API in interleaved rounds; llama-server over its OpenAI /v1/completions.
#
#   bench/serve_side_by_side.sh LLAMA_CPP_DIR MODEL.gguf
#
# LLAMA_CPP_DIR: a llama.cpp checkout OUTSIDE this repository with build/bin/llama-server
# (cmake --build DIR/build --target llama-server). Environment: REQUESTS (16), CONCURRENCY (8),
# PROMPT (64 tokens), GEN (32 tokens), THREADS (2), KV_CACHE (full: the fp32 paged cache, as
# llama-server keeps full-rank K/V; `compressed` for ours), LLAMA_COMMIT (recorded in the
# header). Needs python3-grpcio, protoc and grpc_python_plugin (scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
llama=${1:?usage: serve_side_by_side.sh LLAMA_CPP_DIR MODEL.gguf}
model=${2:?usage: serve_side_by_side.sh LLAMA_CPP_DIR MODEL.gguf}
requests=${REQUESTS:-16}
concurrency=${CONCURRENCY:-8}
prompt=${PROMPT:-64}
gen=${GEN:-32}
threads=${THREADS:-2}
kv_cache=${KV_CACHE:-full}
grpc_port=${GRPC_PORT:-50151}
http_port=${HTTP_PORT:-8181}
rounds=${ROUNDS:-3}
our_http_port=${OUR_HTTP_PORT:-8182}
compare=(python3 bench/serve_compare.py --requests "$requests" --concurrency "$concurrency"
  --prompt-tokens "$prompt" --output-tokens "$gen" --rounds "$rounds")
if [[ ${STREAM:-1} == 1 ]]; then compare+=(--stream); fi
pid=""
cleanup() {
  if [[ -n $pid ]]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  pid=""
}
trap cleanup EXIT

echo "# $(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p'), $threads threads;" \
  "Subspace $(git rev-parse --short=8 HEAD) (--kv-cache $kv_cache), llama.cpp" \
  "${LLAMA_COMMIT:-$(git -C "$llama" rev-parse --short=8 HEAD 2>/dev/null || echo unknown)}"
echo "# $(basename "$model"): $requests requests, $prompt prompt tokens, $gen output tokens," \
  "concurrency $concurrency"
echo

OMP_NUM_THREADS=$threads build/bin/subspace-server --model "$model" --port "$grpc_port" \
  --http-port "$our_http_port" --metrics-port -1 --kv-cache "$kv_cache" \
  >/tmp/subspace-side-by-side-server.log 2>&1 &
pid=$!
build/bin/subspace --server "localhost:$grpc_port" health --wait-seconds 300 >/dev/null
# Prompt ids are drawn below the model's vocabulary size, read from the running server.
vocab=$(build/bin/subspace --server "localhost:$grpc_port" info | sed -n 's/.*vocab[_ ]size[": ]*\([0-9]*\).*/\1/p' | head -1)
compare+=(--vocab "${vocab:?cannot read the vocabulary size from subspace info}")
ours=$("${compare[@]}" --subspace "localhost:$grpc_port" \
  --subspace-http "http://localhost:$our_http_port")
cleanup

"$llama/build/bin/llama-server" -m "$model" -t "$threads" -np "$concurrency" \
  -c $((concurrency * (prompt + gen + 16))) --port "$http_port" \
  >/tmp/subspace-side-by-side-llama.log 2>&1 &
pid=$!
for _ in $(seq 300); do
  curl -sf "http://localhost:$http_port/health" >/dev/null 2>&1 && break
  sleep 1
done
theirs=$("${compare[@]}" --llama "http://localhost:$http_port" --llama-openai)
cleanup

echo "$ours"
echo
echo "$theirs"
# The summary rows: "| name | median (min-max) | ... |"; output tok/s medians over the rounds.
median() { grep "^| $1 | [0-9.]* (" | awk -F'|' '{split($3, a, " "); print a[1]}'; }
a=$(median "Subspace HTTP" <<<"$ours")
b=$(median "llama-server /v1" <<<"$theirs")
echo
awk -v a="$a" -v b="$b" \
  'BEGIN {printf "Subspace HTTP / llama-server /v1 output tokens/s (medians): %.2fx\n", a / b}'
