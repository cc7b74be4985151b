#!/usr/bin/env bash
# Subspace next to llama.cpp on the same GGUF files, in one run on this machine: decode and
# prefill tokens/s of a 1 B random-weight Llama (Llama 3.2 1B's shape, written by our own GGUF
# writer, bench/make_random_llama.py) in F16 and quantized by llama.cpp's own llama-quantize.
#
#   bench/llamacpp_side_by_side.sh LLAMA_CPP_DIR [WORK_DIR]
#
# LLAMA_CPP_DIR: a llama.cpp checkout OUTSIDE this repository (nothing of it is committed; the
# table records its commit). It is built there if build/bin/llama-bench is missing:
#   cmake -S DIR -B DIR/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build DIR/build
#     --target llama-bench llama-quantize
# WORK_DIR (default /tmp/subspace-side-by-side) holds the models (~2.2 GB F16 + the quants).
# Environment: TYPES (default "F16 Q8_0 Q4_0 Q4_K_M Q6_K"), THREADS (2), PROMPT (128), GEN (64),
# REPEATS (3). Ours is build/bin/subspace-bench-cpu (scripts/build.sh first).
#
# Same threads, same files, same prompt length. llama-bench's tg runs from an empty context,
# ours decodes after the PROMPT-token prefill (attention over 128-192 tokens is ~1 % of a
# 1 B model's decode step).
set -euo pipefail
cd "$(dirname "$0")/.."
llama=${1:?usage: llamacpp_side_by_side.sh LLAMA_CPP_DIR [WORK_DIR]}
work=${2:-/tmp/subspace-side-by-side}
types=${TYPES:-F16 Q8_0 Q4_0 Q4_K_M Q6_K}
threads=${THREADS:-2}
prompt=${PROMPT:-128}
gen=${GEN:-64}
repeats=${REPEATS:-3}
mkdir -p "$work"

if [[ ! -x $llama/build/bin/llama-bench ]]; then
  cmake -S "$llama" -B "$llama/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF >/dev/null
  cmake --build "$llama/build" -j"$(nproc)" --target llama-bench llama-quantize
fi
ours=build/bin/subspace-bench-cpu
[[ -x $ours ]] || { echo "build Subspace first: scripts/build.sh" >&2; exit 1; }
commit=${LLAMA_COMMIT:-$(git -C "$llama" rev-parse --short=8 HEAD 2>/dev/null || echo unknown)}

# The machine's sustained read bandwidth now, GB/s.
read_bandwidth() {
  OMP_NUM_THREADS=$threads build/bin/subspace-bench-matmul --types=f32 --shapes=256x256 \
    --ns=1 --min-time=0.05 2>/dev/null | sed -n 's/.*read bandwidth \([0-9.]*\) GB\/s.*/\1/p'
}

f16=$work/llama1b-F16.gguf
if [[ ! -f $f16 ]]; then
  python3 bench/make_random_llama.py --out "$f16" --ctx 4096 >&2
fi

echo "# $(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p'), $threads threads;" \
  "Subspace $(git rev-parse --short=8 HEAD), llama.cpp $commit"
echo "# 1 B random-weight Llama (dim 2048, 16 layers, 32/8 heads, FFN 8192, vocab 32000)," \
  "prompt $prompt, generate $gen, best of $repeats alternating runs of each engine"
echo
echo "# weight GB/s: the weights our decode step streams x decode tokens/s, next to the machine's"
echo "# sustained read bandwidth (subspace-bench-matmul: median of 512 MiB reads by $threads"
echo "# threads), measured before each of our runs, averaged"
echo
echo "| type | file MiB | prefill ours | prefill llama.cpp | ratio | decode ours | decode llama.cpp | ratio | weight GB/s ours | read bandwidth GB/s | fraction |"
echo "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
for type in $types; do
  file=$work/llama1b-$type.gguf
  if [[ ! -f $file ]]; then
    "$llama/build/bin/llama-quantize" "$f16" "$file" "$type" "$threads" >/dev/null 2>&1
  fi
  # The two engines take turns, one repeat each, and each keeps its best: a slow minute on
  # this shared machine then costs both alike. The read bandwidth is measured before each of
  # our runs and averaged.
  ll_pp=0 ll_tg=0 our_pp=0 our_tg=0 bw_sum=0 step_mb=0
  for ((rep = 0; rep < repeats; rep++)); do
    # llama-bench CSV: n_prompt, n_gen, avg_ts are columns 26, 27 and 31.
    csv=$("$llama/build/bin/llama-bench" -m "$file" -t "$threads" -p "$prompt" -n "$gen" \
      -r 1 -o csv 2>/dev/null | tr -d '"')
    ll_pp=$(awk -F, -v p="$prompt" -v best="$ll_pp" \
      '$26 == p && $27 == 0 && $31 + 0 > best + 0 {best = $31 + 0} END {print best}' <<<"$csv")
    ll_tg=$(awk -F, -v g="$gen" -v best="$ll_tg" \
      '$26 == 0 && $27 == g && $31 + 0 > best + 0 {best = $31 + 0} END {print best}' <<<"$csv")
    bw_sum=$(awk -v a="$bw_sum" -v b="$(read_bandwidth)" 'BEGIN {print a + b}')
    # subspace-bench-cpu's row: | batch | cache | prefill tok/s | decode tok/s | ...
    out=$(OMP_NUM_THREADS=$threads "$ours" --model "$file" --batch 1 --kv-cache full \
      --prompt-tokens "$prompt" --decode-tokens "$gen" --repeats 1 2>/dev/null)
    row=$(grep -E '^\| +1 \| full' <<<"$out")
    our_pp=$(awk -F'|' -v best="$our_pp" \
      '{v = $4 + 0; print (v > best + 0 ? v : best + 0)}' <<<"$row")
    our_tg=$(awk -F'|' -v best="$our_tg" \
      '{v = $5 + 0; print (v > best + 0 ? v : best + 0)}' <<<"$row")
    step_mb=$(sed -n 's/^decode weight reads (full, batch 1): \([0-9.]*\) MB a step.*/\1/p' <<<"$out")
  done
  bw=$(awk -v a="$bw_sum" -v n="$repeats" 'BEGIN {printf "%.1f", a / n}')
  our_gbs=$(awk -v m="$step_mb" -v t="$our_tg" 'BEGIN {printf "%.1f", m * t / 1000}')
  mib=$(( $(stat -L -c %s "$file") / 1048576 ))
  awk -v t="$type" -v m="$mib" -v a="$our_pp" -v b="$ll_pp" -v c="$our_tg" -v d="$ll_tg" \
    -v g="$our_gbs" -v w="$bw" 'BEGIN {
      printf "| %s | %d | %.1f | %.1f | %.2fx | %.1f | %.1f | %.2fx | %s | %s | %.0f %% |\n",
        t, m, a, b, a / b, c, d, c / d, g, w, 100 * g / w}'
done
