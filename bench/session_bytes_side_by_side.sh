#!/usr/bin/env bash
# Disk bytes of one saved conversation: Subspace's session snapshot (per KV cache kind) next to
# llama.cpp's slot-save file for the same text on the same model (issue 33's target: ours at
# most 1/8 of llama.cpp's).
#
#   bench/session_bytes_side_by_side.sh LLAMA_CPP_DIR [MODEL=models/subspace-long.gguf]
#
# LLAMA_CPP_DIR: a llama.cpp checkout OUTSIDE this repository with build/bin/llama-server. The
# conversation: the first CHARS (3800) characters of docs/design.md as the prompt, GEN (32)
# greedy tokens after it. Ours: subspace-server with --session-dir, the conversation in a
# session, saved by the drain on SIGTERM (bytes from its log line); once per cache kind in
# KINDS ("full compressed transform"), transform once per key/value budget in BUDGETS
# ("2.5/1.5 2/1", the codec fitted at start-up on the model's own text; a budget ending in
# "+pca", e.g. 2.5/1.5+pca, runs the session with online refresh of its codes, whose snapshot
# carries its refreshed epochs). Theirs:
# llama-server with --slot-save-path, the same prompt through /completion in slot 0, then
# POST /slots/0?action=save (bytes and tokens from its answer).
set -euo pipefail
cd "$(dirname "$0")/.."
llama=${1:?usage: session_bytes_side_by_side.sh LLAMA_CPP_DIR [MODEL]}
model=${2:-models/subspace-long.gguf}
chars=${CHARS:-3800}
gen=${GEN:-32}
kinds=${KINDS:-full compressed transform}
budgets=${BUDGETS:-2.5/1.5 2/1}
port=51079
http_port=8191
work=$(mktemp -d)
source bench/lib.sh
head -c "$chars" docs/design.md >"$work/prompt.txt"

echo "# $(date -u +%Y-%m-%d), Subspace $(git rev-parse --short=8 HEAD), llama.cpp" \
  "${LLAMA_COMMIT:-$(git -C "$llama" rev-parse --short=8 HEAD 2>/dev/null || echo unknown)};" \
  "$(basename "$model"), prompt: $chars characters of docs/design.md, $gen generated tokens"
echo
echo "| saved by | cache | tokens | bytes | bytes / token | vs llama.cpp |"
echo "|---|---|--:|--:|--:|--:|"

# llama.cpp first: its bytes per token is what the ratios divide.
mkdir -p "$work/slots"
"$llama/build/bin/llama-server" -m "$model" -t 2 -np 1 -c 4096 --port "$http_port" \
  --slot-save-path "$work/slots" >"$work/llama.log" 2>&1 &
server_pid=$!  # server_stop (and the EXIT trap) stop it as they stop ours
for _ in $(seq 300); do
  curl -sf "http://localhost:$http_port/health" >/dev/null 2>&1 && break
  sleep 1
done
python3 -c "import json,sys; print(json.dumps({'prompt': open(sys.argv[1]).read(),
  'n_predict': int(sys.argv[2]), 'temperature': 0, 'cache_prompt': True, 'id_slot': 0}))" \
  "$work/prompt.txt" "$gen" >"$work/llama_req.json"
curl -sf "http://localhost:$http_port/completion" -H 'Content-Type: application/json' \
  -d @"$work/llama_req.json" >"$work/llama_out.json"
curl -sf -X POST "http://localhost:$http_port/slots/0?action=save" \
  -H 'Content-Type: application/json' -d '{"filename": "conversation.bin"}' >"$work/llama_save.json"
server_stop
ll_tokens=$(field "$work/llama_save.json" "d['n_saved']")
ll_bytes=$(stat -c %s "$work/slots/conversation.bin")
ll_per=$(python3 -c "print(f'{$ll_bytes / $ll_tokens:.0f}')")
echo "| llama-server slot save | f16 K/V (its default) | $ll_tokens | $ll_bytes | $ll_per | 1.000 |"

runs=()
for kind in $kinds; do
  if [[ $kind == transform ]]; then
    for b in $budgets; do runs+=("transform:$b"); done
  else
    runs+=("$kind")
  fi
done
for run in "${runs[@]}"; do
  kind=${run%%:*}
  flags=(--kv-cache "$kind")
  if [[ $kind == transform ]]; then
    budget=${run#*:}
    if [[ $budget == *+pca ]]; then
      budget=${budget%+pca}
      flags+=(--refresh-method pca)
    fi
    flags+=(--kv-budget "${budget%/*}" --kv-budget-v "${budget#*/}")
  fi
  rm -rf "$work/sessions"
  server_start "$work/ours.log" --model "$model" --session-dir "$work/sessions" \
    --log-level info "${flags[@]}"
  id=$("$client" --server 127.0.0.1:$port session create)
  "$client" --server 127.0.0.1:$port --json generate --session "$id" --max-new-tokens "$gen" \
    --prompt "$(cat "$work/prompt.txt")" >"$work/ours.json"
  server_stop
  # The history saved: prompt and generated tokens (the last one's K/V waits for the next call).
  tokens=$(field "$work/ours.json" "d['usage']['prompt_tokens'] + d['usage']['generated_tokens']")
  bytes=$(sed -n 's/.*saved 1 sessions .* in [0-9.]* s: \([0-9]*\) bytes.*/\1/p' "$work/ours.log")
  [[ -n $bytes ]] || { echo "no save line in the $run server's log" >&2; exit 1; }
  python3 -c "
t, b, lb, lt = $tokens, $bytes, $ll_bytes, $ll_tokens
print(f'| subspace-server drain | $run | {t} | {b} | {b / t:.0f} | {(b / t) / (lb / lt):.3f} |')"
done
