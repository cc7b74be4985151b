#!/usr/bin/env bash
# A stateless client resending its conversation: the second turn's time to first token with the
# server's prompt cache (--prompt-cache-entries 8) and without it (0). Turn 1 is the first CHARS
# (3000) characters of docs/design.md with 16 generated tokens; turn 2 is turn 1's text, its
# answer and a short new line, sent again without a session. ROUNDS (3) rounds, the two servers
# taking turns; medians.
#   bench/prompt_cache.sh [MODEL=models/subspace-long.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/subspace-long.gguf}
chars=${CHARS:-3000}
rounds=${ROUNDS:-3}
port=51083
server=build/bin/subspace-server
client=build/bin/subspace
work=$(mktemp -d)
pid=""
cleanup() {
  if [[ -n $pid ]]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  pid=""
}
trap 'cleanup; rm -rf "$work"' EXIT
head -c "$chars" docs/design.md >"$work/turn1.txt"
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
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
    "$server" --model "$model" --port $port --http-port -1 --metrics-port -1 \
      --prompt-cache-entries "$entries" >"$work/server.log" 2>&1 &
    pid=$!
    "$client" --server 127.0.0.1:$port health --wait-seconds 120 >/dev/null
    generate "$work/turn1.txt" "$work/t1.json"
    { cat "$work/turn1.txt"; field "$work/t1.json" "d['text']"; echo "And then the next part:"; } \
      >"$work/turn2.txt"
    generate "$work/turn2.txt" "$work/t2-$entries.json"
    cleanup
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
