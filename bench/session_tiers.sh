#!/usr/bin/env bash
# A session's next call after the pool gave its blocks to another session: restored from the
# host tier, from the disk tier, or (no tiers) prefilled again. A server on MODEL whose pool
# holds one long session prefills session A (~CHARS characters), then session B (as long: A's
# blocks must go), then continues A by one token; its time to first token is what the tier
# costs. The three modes take turns, ROUNDS rounds; one line per run, then the medians, and
# what a cached token costs in the pool and in each tier (from /metrics while A is tiered).
#   bench/session_tiers.sh [MODEL=models/subspace-long.gguf] [CHARS=3400] [ROUNDS=3] [FLAGS...]
# FLAGS go to every server (default: --kv-cache full --kv-cache-bytes 16777216, which holds one
# ~2,000-token session of the long model and not two; for the default compressed cache,
# --kv-cache-bytes 6291456 does the same).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/subspace-long.gguf}
chars=${2:-3400}
rounds=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--kv-cache full --kv-cache-bytes 16777216)
server=build/bin/subspace-server
client=build/bin/subspace
port=51078
mport=51079
work=$(mktemp -d)
trap 'pkill -f "subspace-server.*--port $port" 2>/dev/null || true; rm -rf "$work"' EXIT
head -c "$chars" docs/design.md > "$work/a.txt"
tail -c "$chars" docs/design.md > "$work/b.txt"

start() {  # mode, log
  local tier=()
  case $1 in
    host) tier=(--session-host-mb 1024) ;;
    disk) tier=(--session-host-mb 0 --session-dir "$work/sessions") ;;
    none) tier=(--session-host-mb 0) ;;
  esac
  "$server" --model "$model" --port $port --http-port -1 --metrics-port $mport --log-level warn \
    "${tier[@]}" "${flags[@]}" > "$2" 2>&1 &
  "$client" --server 127.0.0.1:$port health --wait-seconds 120 > /dev/null
}
stop() { pkill -TERM -f "subspace-server.*--port $port"; while pgrep -f "subspace-server.*--port $port" > /dev/null; do sleep 0.1; done; }
field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
gen() {  # session, prompt file or text, out
  local prompt=$2
  [ -f "$2" ] && prompt=$(cat "$2")
  "$client" --server 127.0.0.1:$port --json generate --session "$1" --max-new-tokens 1 \
    --prompt "$prompt" > "$3"
}

printf "%5s %5s %7s | %9s | %8s %7s | %9s | %10s %10s\n" round mode tokens prefill_s location reused \
  next_ttft pool_B/tok tier_B/tok
results=()
for r in $(seq 1 "$rounds"); do
  for mode in host disk none; do
    rm -rf "$work/sessions"
    start $mode "$work/$mode.log"
    a=$("$client" --server 127.0.0.1:$port session create)
    b=$("$client" --server 127.0.0.1:$port session create)
    gen "$a" "$work/a.txt" "$work/first.json"
    gen "$b" "$work/b.txt" "$work/other.json"
    # The disk tier writes in the background: wait for A's file.
    for _ in $(seq 1 100); do
      "$client" --server 127.0.0.1:$port --json session get "$a" > "$work/info.json"
      location=$(field "$work/info.json" "d.get('cache_location', 'none')")
      [ "$mode" != disk ] || [ "$location" = disk ] && break
      sleep 0.05
    done
    curl -s "http://127.0.0.1:$mport/metrics" > "$work/metrics.txt"
    per_token=$(python3 - "$work/metrics.txt" "$location" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def value(name, labels=""):
    m = re.search(r"^" + re.escape(name + labels) + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
used = sum(value("subspace_kv_pool_used_bytes", '{kind="%s"}' % k) for k in ("full", "compressed", "outlier"))
cached = value("subspace_kv_cached_tokens")
tier = sys.argv[2]
tb = value("subspace_session_tier_bytes", '{tier="%s"}' % tier)
tt = value("subspace_session_tier_tokens", '{tier="%s"}' % tier)
print(f"{used / cached if cached else 0:.0f} {tb / tt if tt else 0:.0f}")
PY
)
    if [ "$location" = pool ]; then
      echo "the pool held both sessions: give the server a smaller --kv-cache-bytes" >&2
      exit 1
    fi
    gen "$a" " and" "$work/next.json"
    stop
    tokens=$(field "$work/first.json" "d['usage']['prompt_tokens']")
    prefill=$(field "$work/first.json" "d['timings']['time_to_first_token_seconds']")
    ttft=$(field "$work/next.json" "d['timings']['time_to_first_token_seconds']")
    reused=$(field "$work/next.json" "d['usage'].get('reused_tokens', 0)")
    printf "%5d %5s %7d | %9.3f | %8s %7d | %9.4f | %10s %10s\n" "$r" $mode "$tokens" "$prefill" \
      "$location" "$reused" "$ttft" $per_token
    results+=("$mode $prefill $ttft $reused")
  done
done
printf '%s\n' "${results[@]}" | python3 -c "
import sys, statistics as st
rows = [l.split() for l in sys.stdin if l.strip()]
by = {}
for mode, prefill, ttft, reused in rows:
    by.setdefault(mode, []).append((float(prefill), float(ttft), int(reused)))
none = st.median(t for _, t, _ in by['none'])
for mode in ('host', 'disk', 'none'):
    ts = [t for _, t, _ in by[mode]]
    print(f'{mode}: next call TTFT median {st.median(ts):.4f} s (min {min(ts):.4f}, max {max(ts):.4f}), '
          f'reused {by[mode][0][2]} tokens, {none / st.median(ts):.1f}x faster than no tiers')"
