# Helpers the server benchmarks share; source it after `cd` to the repository root. It sets an
# EXIT trap that stops the server and removes $work (make $work before sourcing, or leave it
# empty).
#   server_start LOG ARGS...  starts build/bin/subspace-server on 127.0.0.1:$port with ARGS
#                             (no HTTP or metrics port unless ARGS set them), waits until it
#                             answers gRPC health (SERVER_WAIT seconds, 300)
#   server_stop               SIGTERM (a drain) and waits for the process to exit
#   field FILE EXPR           prints EXPR of the JSON in FILE, the object bound to d
#                             ("d['usage']['prompt_tokens']")
server=${server:-build/bin/subspace-server}
client=${client:-build/bin/subspace}
server_pid=""

server_start() {
  local log=$1
  shift
  "$server" --port "$port" --http-port -1 --metrics-port -1 "$@" >"$log" 2>&1 &
  server_pid=$!
  "$client" --server "127.0.0.1:$port" health --wait-seconds "${SERVER_WAIT:-300}" >/dev/null
}

server_stop() {
  if [[ -n $server_pid ]]; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  server_pid=""
}

field() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

trap 'server_stop; [[ -n ${work:-} ]] && rm -rf "$work"' EXIT
