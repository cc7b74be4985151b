#!/usr/bin/env bash
# The HTTP API with curl, as the README shows it: a real subspace-server on free ports, then
# models, a completion, a streamed chat (server-sent events ending in [DONE]), a session, and
# errors as OpenAI's JSON with the right status (a bad field, an unknown model, a body too large).
#   tests/http/curl_test.sh SERVER_BIN MODEL CHAT_TEMPLATE
set -euo pipefail
server_bin=$1 model=$2 template=$3
work=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT

"$server_bin" --model "$model" --chat-template "$template" --host 127.0.0.1 --port 0 \
  --http-port 0 --metrics-port -1 --max-message-bytes 65536 --log-level warn >"$work/out" 2>&1 &
pid=$!
port=""
for _ in $(seq 300); do
  if [[ $(cat "$work/out") =~ http\ port\ ([0-9]+) ]]; then port=${BASH_REMATCH[1]}; break; fi
  kill -0 "$pid" 2>/dev/null || { cat "$work/out"; exit 1; }
  sleep 0.1
done
[[ -n $port ]] || { echo "curl_test: no http port"; cat "$work/out"; exit 1; }
api="http://127.0.0.1:$port/v1"
fail() { echo "curl_test: $*" >&2; exit 1; }

id=$(basename "$model" .gguf)
curl -sf "$api/models" | grep -q "\"id\":\"$id\"" || fail "models does not list $id"

out=$(curl -sf "$api/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$id\", \"prompt\": \"Once upon a time\", \"max_tokens\": 5, \"temperature\": 0}")
grep -q '"object":"text_completion"' <<<"$out" || fail "completion: $out"
grep -q '"completion_tokens":5' <<<"$out" || fail "completion usage: $out"

out=$(curl -sfN "$api/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$id\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}],
       \"max_tokens\": 4, \"stream\": true, \"stream_options\": {\"include_usage\": true}}")
[[ $(grep -c '^data: ' <<<"$out") -ge 4 ]] || fail "stream: $out"
grep -q '"role":"assistant"' <<<"$out" || fail "stream has no role: $out"
[[ $(tail -n 1 <<<"$out") == "data: [DONE]" ]] || fail "stream does not end in [DONE]: $out"

session=$(curl -sf "$api/sessions" -d '{}' | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
[[ -n $session ]] || fail "no session"
curl -sf "$api/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$id\", \"prompt\": \"Once\", \"max_tokens\": 2, \"session_id\": \"$session\"}" \
  >/dev/null || fail "completion on the session"
curl -sf "$api/sessions/$session" | grep -q '"tokens":' || fail "session info"
curl -sf -X DELETE "$api/sessions/$session" | grep -q '"deleted":true' || fail "delete"

status() { curl -s -o "$work/body" -w '%{http_code}' "$@"; }
[[ $(status "$api/completions" -d "{\"model\": \"$id\", \"prompt\": \"a\", \"top_p\": 7}") == 400 ]] ||
  fail "bad top_p: $(cat "$work/body")"
grep -q '"message":"top_p must be in (0, 1], got 7"' "$work/body" || fail "message: $(cat "$work/body")"
grep -q '"param":"top_p"' "$work/body" || fail "param: $(cat "$work/body")"
[[ $(status "$api/completions" -d '{"model": "other", "prompt": "a"}') == 404 ]] || fail "model"
grep -q '"code":"model_not_found"' "$work/body" || fail "code: $(cat "$work/body")"
head -c 70000 /dev/zero | tr '\0' ' ' >"$work/big"
[[ $(status "$api/completions" --data-binary @"$work/big") == 413 ]] || fail "body too large"
[[ $(status "http://127.0.0.1:$port/health") == 200 ]] || fail "health"
echo "curl_test: ok"
