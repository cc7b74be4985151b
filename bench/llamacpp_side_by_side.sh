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
# ROUNDS (5), RAW (a file to append every round's numbers to). Ours is
# build/bin/subspace-bench-cpu (scripts/build.sh first).
#
# This machine is shared and its memory bandwidth moves from minute to minute, so one run of
# each engine, or the best of several, says little: the engines take turns, ROUNDS times (who
# goes first alternates), and each cell is the MEDIAN over rounds of the per-round ratio
# ours / llama.cpp, with its min and max. Each engine's decode bandwidth is the weight bytes a
# step reads (the same file, so the same bytes) times its own decode tokens/s, next to the
# machine's read bandwidth measured in the same round.
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
rounds=${ROUNDS:-5}
raw=${RAW:-/dev/null}
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

# One round of llama-bench: prints "prefill decode" tokens/s.
# llama-bench CSV: n_prompt, n_gen, avg_ts are columns 26, 27 and 31.
run_llama() {
  "$llama/build/bin/llama-bench" -m "$1" -t "$threads" -p "$prompt" -n "$gen" -r 1 -o csv \
    2>/dev/null | tr -d '"' | awk -F, -v p="$prompt" -v g="$gen" '
      $26 == p && $27 == 0 {pp = $31} $26 == 0 && $27 == g {tg = $31}
      END {print pp + 0, tg + 0}'
}

# One round of ours: prints "prefill decode step_mb" (subspace-bench-cpu's row:
# | batch | cache | prefill tok/s | decode tok/s | ...).
run_ours() {
  local out
  out=$(OMP_NUM_THREADS=$threads "$ours" --model "$1" --batch 1 --kv-cache full \
    --prompt-tokens "$prompt" --decode-tokens "$gen" --repeats 1 2>/dev/null)
  local mb
  mb=$(sed -n 's/^decode weight reads (full, batch 1): \([0-9.]*\) MB a step.*/\1/p' <<<"$out")
  grep -E '^\| +1 \| full' <<<"$out" | awk -F'|' -v mb="$mb" '{print $4 + 0, $5 + 0, mb + 0}'
}

# Median, min and max of a column of numbers on stdin: "median min max".
stats() {
  sort -g | awk '{v[NR] = $1} END {
    m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    print m, v[1], v[NR]}'
}

f16=$work/llama1b-F16.gguf
if [[ ! -f $f16 ]]; then
  python3 bench/make_random_llama.py --out "$f16" --ctx 4096 >&2
fi

echo "# $(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p'), $threads threads;" \
  "Subspace $(git rev-parse --short=8 HEAD), llama.cpp $commit"
echo "# 1 B random-weight Llama (dim 2048, 16 layers, 32/8 heads, FFN 8192, vocab 32000)," \
  "prompt $prompt, generate $gen; $rounds interleaved rounds"
echo "# tokens/s: median over rounds; ratio: median of the per-round ratios ours / llama.cpp"
echo "# [min-max]; GB/s: weight bytes a decode step reads x that engine's decode tokens/s"
echo "# (median), next to the machine's read bandwidth (median of 512 MiB reads by $threads"
echo "# threads, measured once a round)"
echo
echo "| type | file MiB | prefill ours | llama.cpp | ratio [min-max] | decode ours | llama.cpp | ratio [min-max] | decode GB/s ours | llama.cpp | read GB/s |"
echo "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
for type in $types; do
  file=$work/llama1b-$type.gguf
  if [[ ! -f $file ]]; then
    "$llama/build/bin/llama-quantize" "$f16" "$file" "$type" "$threads" >/dev/null 2>&1
  fi
  rows=()
  for ((round = 0; round < rounds; round++)); do
    bw=$(read_bandwidth)
    if ((round % 2 == 0)); then
      theirs=$(run_llama "$file")
      mine=$(run_ours "$file")
    else
      mine=$(run_ours "$file")
      theirs=$(run_llama "$file")
    fi
    # round: our_pp our_tg step_mb their_pp their_tg read_bw
    rows+=("$mine $theirs ${bw:-0}")
    echo "$type $round $mine $theirs ${bw:-0}" >>"$raw"
  done
  all=$(printf '%s\n' "${rows[@]}")
  col() { awk "{print $1}" <<<"$all" | stats; }
  read -r our_pp _ _ <<<"$(col '$1')"
  read -r our_tg _ _ <<<"$(col '$2')"
  read -r ll_pp _ _ <<<"$(col '$4')"
  read -r ll_tg _ _ <<<"$(col '$5')"
  read -r bw _ _ <<<"$(col '$6')"
  read -r pr pr_lo pr_hi <<<"$(col '($4 > 0 ? $1 / $4 : 0)')"
  read -r dr dr_lo dr_hi <<<"$(col '($5 > 0 ? $2 / $5 : 0)')"
  read -r our_gbs _ _ <<<"$(col '$3 * $2 / 1000')"
  read -r ll_gbs _ _ <<<"$(col '$3 * $5 / 1000')"
  mib=$(($(stat -L -c %s "$file") / 1048576))
  awk -v t="$type" -v m="$mib" -v a="$our_pp" -v b="$ll_pp" -v r="$pr" -v r0="$pr_lo" \
    -v r1="$pr_hi" -v c="$our_tg" -v d="$ll_tg" -v s="$dr" -v s0="$dr_lo" -v s1="$dr_hi" \
    -v g="$our_gbs" -v h="$ll_gbs" -v w="$bw" 'BEGIN {
      printf "| %s | %d | %.1f | %.1f | %.2fx [%.2f-%.2f] | %.1f | %.1f | %.2fx [%.2f-%.2f] |" \
        " %.1f | %.1f | %.1f |\n", t, m, a, b, r, r0, r1, c, d, s, s0, s1, g, h, w}'
done
