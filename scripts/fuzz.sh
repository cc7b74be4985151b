#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan; build-fuzz/) and runs each for a bounded
# time on a temporary copy of its committed corpus (fuzz/corpus/<target>), so the repository is
# never written. Fails on any crash, leak, sanitizer report or property violation; the crashing
# input is kept under build-fuzz/crashes/. Usage: scripts/fuzz.sh [SECONDS_PER_TARGET=20]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-20}"
scripts/setup.sh

cmake --preset fuzz >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target subspace_fuzzers

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
crashes=build-fuzz/crashes
mkdir -p "$crashes"

# corpus folder per target
declare -A corpus=(
  [gguf_fuzzer]=gguf
  [basis_file_fuzzer]=basis_file
  [tokenizer_fuzzer]=tokenizer
  [bpe_tokenizer_fuzzer]=bpe_tokenizer
  [chat_template_fuzzer]=chat_template
  [request_fuzzer]=request
  [openai_request_fuzzer]=openai_request
  [session_snapshot_fuzzer]=session_snapshot
)
# The GGUF targets get a dictionary of the format's magic and the keys the parsers look for; the
# OpenAI bodies one of JSON's syntax and the API's field names.
declare -A dict=(
  [gguf_fuzzer]=fuzz/gguf.dict
  [basis_file_fuzzer]=fuzz/gguf.dict
  [openai_request_fuzzer]=fuzz/json.dict
)

failed=()
for target in gguf_fuzzer basis_file_fuzzer tokenizer_fuzzer bpe_tokenizer_fuzzer chat_template_fuzzer \
              request_fuzzer openai_request_fuzzer session_snapshot_fuzzer; do
  dir="$work/${corpus[$target]}"
  cp -r "fuzz/corpus/${corpus[$target]}" "$dir"
  args=(-max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048
        -print_final_stats=1 -artifact_prefix="$crashes/$target-")
  if [[ -n "${dict[$target]:-}" ]]; then args+=(-dict="${dict[$target]}"); fi
  echo "fuzz: $target for ${seconds}s"
  if ! build-fuzz/bin/"$target" "${args[@]}" "$dir" >"$work/$target.log" 2>&1; then
    tail -n 60 "$work/$target.log"
    failed+=("$target")
  fi
  grep -E '^stat::number_of_executed_units|^#[0-9]+.*DONE' "$work/$target.log" || true
done

if ((${#failed[@]})); then
  echo "fuzz: FAILED: ${failed[*]} (inputs under $crashes/)" >&2
  exit 1
fi
echo "fuzz: all targets clean"
