#!/usr/bin/env bash
# The quantized types end to end against llama.cpp: the default model quantized to each type by
# llama.cpp's llama-quantize; perplexity on the test split, ours (subspace-run --ppl, windows of
# 512) and theirs (llama-perplexity -c 512, which scores the second half of each window), each
# as a ratio to its own F16 number; and greedy text for a few prompts, ours vs llama-simple's.
#
#   bench/llamacpp_quant_quality.sh LLAMA_CPP_DIR [WORK_DIR]
#
# LLAMA_CPP_DIR: a llama.cpp checkout OUTSIDE this repository, with build/bin/llama-quantize,
# llama-perplexity and llama-simple built (see bench/llamacpp_side_by_side.sh). Environment:
# MODEL (models/subspace-tiny.gguf), TYPES, TEXT_BYTES (bytes of models/data/test.txt scored,
# default 60000), THREADS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
llama=${1:?usage: llamacpp_quant_quality.sh LLAMA_CPP_DIR [WORK_DIR]}
work=${2:-/tmp/subspace-quant-quality}
model=${MODEL:-models/subspace-tiny.gguf}
types=${TYPES:-Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_M Q4_K_M Q5_K_M Q6_K IQ4_NL}
threads=${THREADS:-2}
bin=$llama/build/bin
mkdir -p "$work"
text=$work/test-prefix.txt
head -c "${TEXT_BYTES:-60000}" models/data/test.txt >"$text"
prompts=("The king said" "And it came to pass" "In the morning")

ours_ppl() {
  OMP_NUM_THREADS=$threads build/bin/subspace-run --model "$1" --ppl "$text" --ppl-window 512 \
    2>/dev/null | sed -n 's/^perplexity \([0-9.]*\) .*/\1/p'
}
theirs_ppl() {
  "$bin/llama-perplexity" -m "$1" -f "$text" -c 512 -t "$threads" 2>&1 |
    sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p'
}
# Greedy continuations, one line per prompt. llama-simple prints "<s> " + prompt + text.
ours_text() {
  for p in "${prompts[@]}"; do
    OMP_NUM_THREADS=$threads build/bin/subspace-run --model "$1" --prompt "$p" -n 32 \
      2>/dev/null | tr '\n' ' '
    echo
  done
}
theirs_text() {
  for p in "${prompts[@]}"; do
    "$bin/llama-simple" -m "$1" -n 32 "$p" 2>/dev/null | sed 's/^<s> //' | tr '\n' ' '
    echo
  done
}

commit=${LLAMA_COMMIT:-$(git -C "$llama" rev-parse --short=8 HEAD 2>/dev/null || echo unknown)}
echo "# $(date -u +%Y-%m-%d), $model, $(wc -c <"$text") bytes of models/data/test.txt;" \
  "Subspace $(git rev-parse --short=8 HEAD), llama.cpp $commit, $threads threads"
echo
echo "| type | MiB | ppl ours | ratio to F16 | ppl llama.cpp | ratio to F16 | ratios differ | greedy text |"
echo "|---|--:|--:|--:|--:|--:|--:|---|"
f16_ours=$(ours_ppl "$model")
f16_theirs=$(theirs_ppl "$model")
for type in F16 $types; do
  file=$model
  if [[ $type != F16 ]]; then
    file=$work/$(basename "$model" .gguf)-$type.gguf
    [[ -f $file ]] || "$bin/llama-quantize" "$model" "$file" "$type" "$threads" >/dev/null 2>&1
  fi
  a=$( [[ $type == F16 ]] && echo "$f16_ours" || ours_ppl "$file")
  b=$( [[ $type == F16 ]] && echo "$f16_theirs" || theirs_ppl "$file")
  if [[ $(ours_text "$file") == $(theirs_text "$file") ]]; then same=identical; else same=DIFFERS; fi
  mib=$(awk -v s="$(stat -L -c %s "$file")" 'BEGIN {printf "%.1f", s / 1048576}')
  awk -v t="$type" -v m="$mib" -v a="$a" -v b="$b" -v fa="$f16_ours" -v fb="$f16_theirs" \
    -v g="$same" 'BEGIN {ra = a / fa; rb = b / fb;
      printf "| %s | %s | %.3f | %.4f | %.3f | %.4f | %+.2f %% | %s |\n", t, m, a, ra, b, rb,
        100 * (ra / rb - 1), g}'
done
