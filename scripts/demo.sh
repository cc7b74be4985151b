#!/usr/bin/env bash
# Set-up, build, then the main job: start subspace-server on the long-context model and drive it
# with the `subspace` client (health, model info, greedy and sampled generation, a session reusing
# its KV cache, a pass key retrieved from ~650 tokens back through the default cache, which codes
# this model's older blocks with its own transform codec, cache stats), show a /metrics excerpt,
# and stop the server with SIGTERM (exit code 0).
# MODEL=models/subspace-tiny.gguf runs it on the small default-context model instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh

MODEL=${MODEL:-models/subspace-long.gguf}
SESSION_TOKENS=64  # per session turn: enough for blocks to leave the 64-token window
if [[ ! -f $MODEL && $MODEL == models/subspace-*.gguf ]]; then
  fallback=build/test_data/gqa_f32.gguf
  if [[ ! -f $fallback ]]; then
    /usr/bin/python3 tests/reference/make_reference.py --out build/test_data >/dev/null
  fi
  echo "note: $MODEL is not there yet; using $fallback instead, a random-weight"
  echo "      test model: the serving path is real, the generated text is noise."
  MODEL=$fallback
  SESSION_TOKENS=8
fi
[[ -f $MODEL ]] || { echo "demo: no model at $MODEL" >&2; exit 1; }

LOG=build/demo-server.log
SERVER_PID=""
stop_server() {  # SIGTERM (graceful drain), then the exit code in SERVER_RC
  SERVER_RC=0
  if [[ -n $SERVER_PID ]]; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" || SERVER_RC=$?
    SERVER_PID=""
  fi
}
trap stop_server EXIT
trap 'exit 130' INT TERM  # so the EXIT trap runs on Ctrl-C too

echo "== starting subspace-server on $MODEL (log: $LOG)"
: >"$LOG"  # truncated here, not in the child, so the wait below never reads the last run's port
build/bin/subspace-server --model "$MODEL" --port 0 --metrics-port 0 --http-port 0 --host 127.0.0.1 \
  >>"$LOG" 2>&1 &
SERVER_PID=$!
# server/main.cc prints "subspace-server listening on port P, metrics port M" once it serves.
PORT="" METRICS_PORT="" line=""
for _ in $(seq 600); do  # 60 s
  line=$(grep -m1 '^subspace-server listening on port' "$LOG" || true)
  if [[ $line =~ port\ ([0-9]+),\ metrics\ port\ (-?[0-9]+) ]]; then
    PORT=${BASH_REMATCH[1]} METRICS_PORT=${BASH_REMATCH[2]}
    break
  fi
  kill -0 "$SERVER_PID" 2>/dev/null || break  # exited: its log says why
  sleep 0.1
done
if [[ -z $PORT ]]; then
  echo "demo: subspace-server did not come up; its log:" >&2
  cat "$LOG" >&2
  exit 1
fi
echo "$line"
CLIENT=(build/bin/subspace --server "127.0.0.1:$PORT" --timeout-seconds 120)

echo
echo "== health (waits up to 60 s for SERVING)"
"${CLIENT[@]}" health --wait-seconds 60

echo
echo "== model info"
"${CLIENT[@]}" info

echo
echo "== generate, greedy"
"${CLIENT[@]}" generate --prompt "And God said unto Moses," --max-new-tokens 48

echo
echo "== stream, sampled: temperature 0.8, top-p 0.95, seed 7"
"${CLIENT[@]}" stream --prompt "Blessed are they that" --max-new-tokens 48 \
  --temperature 0.8 --top-p 0.95 --seed 7

echo
echo "== session: the second call reuses the first call's KV cache (see \"reused\")"
SESSION=$("${CLIENT[@]}" session create)
echo "created session $SESSION"
"${CLIENT[@]}" generate --session "$SESSION" --prompt "In the beginning" \
  --max-new-tokens "$SESSION_TOKENS"
"${CLIENT[@]}" generate --session "$SESSION" --prompt "And the LORD said" \
  --max-new-tokens "$SESSION_TOKENS"
"${CLIENT[@]}" session get "$SESSION"

if [[ $SESSION_TOKENS -gt 8 ]]; then  # a trained model
  echo
  echo "== long session: a pass key ~650 tokens back, retrieved through the transform-coded cache"
  # From the held-out test split, as the long-context evaluation writes them (its own seed).
  PASSKEY_PROMPT=build/demo-passkey.txt
  key=$(/usr/bin/python3 - "$PASSKEY_PROMPT" <<'PY'
import sys
sys.path.insert(0, "tools/train")
import numpy as np
import sentencepiece as spm
import longctx
sp = spm.SentencePieceProcessor(model_file="models/subspace-tiny.tokenizer.model")
texts = longctx.Texts(sp, sp.encode(open("models/data/test.txt", encoding="utf-8").read()))
d = longctx.passkey(sp, texts, np.random.default_rng(2026), 900, 0.25, haystack="natural")
open(sys.argv[1], "w", encoding="utf-8").write(d["prompt"])
print(d["answer"].strip())
PY
)
  LONG=$("${CLIENT[@]}" session create)
  echo "prompt: $(wc -w <"$PASSKEY_PROMPT") words, the key ($key) at 25 % depth; ...$(tail -c 120 "$PASSKEY_PROMPT")"
  "${CLIENT[@]}" generate --session "$LONG" --prompt "$(cat "$PASSKEY_PROMPT")" --max-new-tokens 6
fi

echo
echo "== KV cache stats while the session holds its cache (blocks past the window are coded)"
"${CLIENT[@]}" stats

echo
echo "== /metrics excerpt (http://127.0.0.1:$METRICS_PORT/metrics)"
metrics=$(curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics")
grep -m1 -E '^subspace_requests_total\{.*status="OK"' <<<"$metrics" || true
grep -m1 -E '^subspace_generation_tokens_total' <<<"$metrics" || true
grep -E '^subspace_kv_pool_used_bytes\{' <<<"$metrics" || true
grep -m1 -E '^subspace_kv_compression_ratio' <<<"$metrics" || true

"${CLIENT[@]}" session delete "$SESSION"
echo "deleted session $SESSION"
if [[ -n ${LONG:-} ]]; then "${CLIENT[@]}" session delete "$LONG" >/dev/null; fi

echo
echo "== stopping subspace-server (SIGTERM)"
stop_server
echo "subspace-server exited with code $SERVER_RC"
exit "$SERVER_RC"
