#!/usr/bin/env bash
# scripts/migrate_sessions.sh between two real servers: two sessions with the same first turn on
# server A, one of them continued there; the script moves both to server B (and off A); the
# other one's second turn on B reuses its moved cache and gives, token for token, what the
# second turn gave on A. A session the target refuses (a live id) stays on the source and the
# script exits 1. With bearer tokens, an operator token moves two principals' sessions in one run,
# and each stays its owner's.
#   tests/http/migrate_sessions_test.sh SERVER_BIN MODEL SCRIPT
set -euo pipefail
server_bin=$1 model=$2 script=$3
work=$(mktemp -d)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do
    kill "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "migrate_sessions_test: $*" >&2; exit 1; }

# Starts a server (more flags after its number), prints its HTTP port.
start() {
  local out=$work/server$1.out
  shift
  "$server_bin" --model "$model" --host 127.0.0.1 --port 0 --http-port 0 --metrics-port -1 \
    --log-level warn "$@" >"$out" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do
    if [[ $(cat "$out") =~ http\ port\ ([0-9]+) ]]; then echo "${BASH_REMATCH[1]}"; return; fi
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$out" >&2; return 1; }
    sleep 0.1
  done
  cat "$out" >&2
  return 1
}
a="http://127.0.0.1:$(start 1)"
b="http://127.0.0.1:$(start 2)"
id=$(basename "$model" .gguf)

session() { curl -sf "$1/v1/sessions" -d '{}' | sed -n 's/.*"id":"\([^"]*\)".*/\1/p'; }
# A greedy turn on a session: prints the completion's JSON.
turn() {
  curl -sf "$1/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$id\", \"prompt\": \"$3\", \"max_tokens\": 8, \"temperature\": 0,
         \"session_id\": \"$2\"}"
}
text() { sed -n 's/.*"text":"\([^"]*\)".*/\1/p'; }

moved=$(session "$a")
stayed=$(session "$a")
[[ -n $moved && -n $stayed ]] || fail "no sessions"
first="Once upon a time there was a little"
one=$(turn "$a" "$moved" "$first" | text)
[[ $one == "$(turn "$a" "$stayed" "$first" | text)" ]] || fail "the same first turn differs"
want=$(turn "$a" "$stayed" " dog who" | text)

bash "$script" "$a" "$b" >"$work/migrate.out" 2>&1 || { cat "$work/migrate.out"; fail "migration"; }
grep -q '2 moved, 0 failed' "$work/migrate.out" || fail "migration: $(cat "$work/migrate.out")"
[[ $(curl -sf "$a/v1/sessions") != *'"id":"'* ]] || fail "sessions left on A: $(curl -sf "$a/v1/sessions")"
curl -sf "$b/v1/sessions/$moved" | grep -q '"cached_tokens":[1-9]' || fail "no cache moved"

got=$(turn "$b" "$moved" " dog who")
[[ $(text <<<"$got") == "$want" ]] || fail "continued on B: '$(text <<<"$got")', on A: '$want'"
grep -q '"cached_tokens":[1-9]' <<<"$got" || fail "the continuation did not reuse the cache: $got"

# Moving again onto a server that already holds the session: refused, kept on the source.
curl -sf "$b/v1/sessions/$moved" >/dev/null
if bash "$script" "$b" "$b" >"$work/again.out" 2>&1; then fail "a live id was imported"; fi
grep -q 'HTTP 409' "$work/again.out" || fail "no 409: $(cat "$work/again.out")"
curl -sf "$b/v1/sessions/$moved" >/dev/null || fail "the refused session left its source"

# Two principals' sessions, moved by an operator token; each stays its owner's on the target.
tok_a=token-a-3e8d1f0b7c2a9654 tok_b=token-b-5a0c9e2f4d1b8376 tok_ops=token-ops-7f3b2d9e0c4a1865
printf '%s\n%s\n' "$tok_a" "$tok_b" >"$work/tokens"
echo "$tok_ops" >"$work/operators"
auth=(--auth-tokens "$work/tokens" --operator-tokens "$work/operators")
c="http://127.0.0.1:$(start 3 "${auth[@]}")"
d="http://127.0.0.1:$(start 4 "${auth[@]}")"
as() { local t=$1; shift; curl -sf -H "Authorization: Bearer $t" "$@"; }
owned_a=$(as "$tok_a" "$c/v1/sessions" -d '{}' | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
owned_b=$(as "$tok_b" "$c/v1/sessions" -d '{}' | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
[[ -n $owned_a && -n $owned_b ]] || fail "no sessions with tokens"
if bash "$script" "$c" "$d" --token "$tok_a" >"$work/owner.out" 2>&1; then :; else
  fail "an owner's migration: $(cat "$work/owner.out")"
fi
grep -q '1 moved, 0 failed' "$work/owner.out" || fail "an owner moved others': $(cat "$work/owner.out")"
bash "$script" "$c" "$d" --token "$tok_ops" >"$work/ops.out" 2>&1 || fail "$(cat "$work/ops.out")"
grep -q '1 moved, 0 failed' "$work/ops.out" || fail "operator migration: $(cat "$work/ops.out")"
[[ $(as "$tok_ops" "$c/v1/sessions") != *'"id":"'* ]] || fail "sessions left on C"
[[ $(as "$tok_a" "$d/v1/sessions") == *"\"id\":\"$owned_a\""* ]] || fail "A's session not A's on D"
[[ $(as "$tok_b" "$d/v1/sessions") == *"\"id\":\"$owned_b\""* ]] || fail "B's session not B's on D"
[[ $(as "$tok_b" "$d/v1/sessions") != *"$owned_a"* ]] || fail "B sees A's session on D"
echo "migrate_sessions_test: ok"
