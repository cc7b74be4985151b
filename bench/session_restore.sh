#!/usr/bin/env bash
# Restoring a session from --session-dir against recomputing it: a server on MODEL prefills a
# session of ~TOKENS tokens (its time to first token is the prefill), drains on SIGTERM (the
# save), starts again on the directory (the restore, from its log) and continues the session
# (its time to first token with every token reused). ROUNDS rounds; one line each, then the
# medians and the restore's speed-up over the prefill.
#   bench/session_restore.sh [MODEL=models/subspace-long.gguf] [CHARS=3800] [ROUNDS=3] [FLAGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/subspace-long.gguf}
chars=${2:-3800}
rounds=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
port=51077
work=$(mktemp -d)
source bench/lib.sh
head -c "$chars" docs/design.md > "$work/prompt.txt"

start() {  # logs to $1
  local log=$1
  shift
  server_start "$log" --model "$model" --session-dir "$work/sessions" --log-level info "$@"
}

printf "%5s %7s | %9s | %9s %10s | %9s | %9s %6s\n" round tokens prefill_s save_s bytes restore_s ttft_s speedup
results=()
for r in $(seq 1 "$rounds"); do
  rm -rf "$work/sessions"
  start "$work/a.log" "$@"
  id=$("$client" --server 127.0.0.1:$port session create)
  "$client" --server 127.0.0.1:$port --json generate --session "$id" --max-new-tokens 1 \
    --prompt "$(cat "$work/prompt.txt")" > "$work/first.json"
  server_stop
  start "$work/b.log" "$@"
  "$client" --server 127.0.0.1:$port --json generate --session "$id" --max-new-tokens 1 \
    --prompt " and" > "$work/next.json"
  server_stop
  tokens=$(field "$work/first.json" "d['usage']['prompt_tokens']")
  prefill=$(field "$work/first.json" "d['timings']['time_to_first_token_seconds']")
  ttft=$(field "$work/next.json" "d['timings']['time_to_first_token_seconds']")
  reused=$(field "$work/next.json" "d['usage']['reused_tokens']")
  save=$(sed -n 's/.*saved 1 sessions .* in \([0-9.]*\) s: \([0-9]*\) bytes.*/\1 \2/p' "$work/a.log")
  restore=$(sed -n 's/.*restored 1 sessions .* in \([0-9.]*\) s.*/\1/p' "$work/b.log")
  [ "$reused" -ge "$tokens" ] || { echo "round $r: only $reused of $tokens tokens reused" >&2; exit 1; }
  speedup=$(python3 -c "print(f'{$prefill / ($restore + $ttft):.1f}')")
  printf "%5d %7d | %9.3f | %9s %10s | %9.3f | %9.4f %6s\n" "$r" "$tokens" "$prefill" $save \
    "$restore" "$ttft" "$speedup"
  results+=("$prefill $restore $ttft")
done
printf '%s\n' "${results[@]}" | python3 -c "
import sys, statistics as st
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
p, r, t = (st.median(c) for c in zip(*rows))
ratios = [a / (b + c) for a, b, c in rows]
print(f'median: prefill {p:.3f} s, restore {r:.3f} s + first call {t:.4f} s: restored is {st.median(ratios):.1f}x '
      f'faster than re-prefilling (min {min(ratios):.1f}, max {max(ratios):.1f})')"
