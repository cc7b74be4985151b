#!/usr/bin/env bash
# A stateless client resending its conversation: the second turn's time to first token with the
# server's prompt cache (--prompt-cache-entries 8) and without it (0). Turn 1 is the first CHARS
# (3000) characters of docs/design.md with 16 generated tokens; turn 2 is turn 1's text, its
# answer and a short new line, sent again without a session. ROUNDS (3) rounds, the two servers
# taking turns; medians. On a lossy cache (the default compressed one) the answers may differ:
# the reused cache holds turn 1's older blocks coded, where a fresh prefill attends to its whole
# chunk exact; on --kv-cache full they are the same.
#   bench/prompt_cache.sh [MODEL=models/subspace-long.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/subspace-long.gguf}
chars=${CHARS:-3000}
rounds=${ROUNDS:-3}
port=51083
work=$(mktemp -d)
source bench/lib.sh
head -c "$chars" docs/design.md >"$work/turn1.txt"
generate() {  # prompt file, output json
  "$client" --server 127.0.0.1:$port --json generate --max-new-tokens 16 \
    --prompt "$(cat "$1")" >"$2"
}

echo "# $(date -u +%Y-%m-%d), Subspace $(git rev-parse --short=8 HEAD), $(basename "$model")," \
  "turn 1: $chars characters; $rounds rounds"
echo "| round | entries | turn 2 prompt tokens | reused | turn 2 TTFT s | same answer as without |"
echo "|--:|--:|--:|--:|--:|---|"
rows=()
for ((r = 1; r <= rounds; r++)); do
  for entries in 8 0; do
    server_start "$work/server.log" --model "$model" --prompt-cache-entries "$entries"
    generate "$work/turn1.txt" "$work/t1.json"
    { cat "$work/turn1.txt"; field "$work/t1.json" "d['text']"; echo "And then the next part:"; } \
      >"$work/turn2.txt"
    generate "$work/turn2.txt" "$work/t2-$entries.json"
    server_stop
    tokens=$(field "$work/t2-$entries.json" "d['usage']['prompt_tokens']")
    reused=$(field "$work/t2-$entries.json" "d['usage'].get('reused_tokens', 0)")
    ttft=$(field "$work/t2-$entries.json" "d['timings']['time_to_first_token_seconds']")
    same=-
    if [[ $entries == 0 ]]; then
      same=$(python3 -c "import json,sys; a, b = (json.load(open(f))['text'] for f in sys.argv[1:])
print('yes' if a == b else 'NO')" "$work/t2-8.json" "$work/t2-0.json")
    fi
    echo "| $r | $entries | $tokens | $reused | $ttft | $same |"
    rows+=("$entries $ttft")
  done
done
printf '%s\n' "${rows[@]}" | python3 -c "
import sys, statistics as st
by = {}
for line in sys.stdin:
    e, t = line.split()
    by.setdefault(e, []).append(float(t))
on, off = st.median(by['8']), st.median(by['0'])
print(f'median turn-2 TTFT: {on:.4f} s with the prompt cache, {off:.4f} s without: {off / on:.1f}x')"
