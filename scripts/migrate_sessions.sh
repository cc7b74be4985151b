#!/usr/bin/env bash
# Moves sessions from one subspace server to another over the HTTP API, before the first is
# drained (docs/sessions.md, "Moving a session between replicas"): for each session the token
# owns on FROM (GET /v1/sessions; an operator token lists every principal's), its snapshot
# (GET /v1/sessions/ID/snapshot) is put on TO (PUT, with the same token, and the id as
# x-session-id so a session-affine proxy in front of the replicas routes it where its calls will
# go), then deleted on FROM once TO holds it.
# A session that fails to move stays on FROM and is reported; the exit status is then 1.
#   scripts/migrate_sessions.sh FROM_URL TO_URL [--token TOKEN] [--keep]
#   FROM_URL, TO_URL: the HTTP API's base, e.g. http://10.0.0.5:8080
#   --token: the owner's bearer token (sessions are per owner: run once per token), or an
#            operator token (the servers' --operator-tokens) to move every principal's sessions,
#            each staying its owner's
#   --keep: leave the sessions on FROM too
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
from=${1%/} to=${2%/}
shift 2
token="" keep=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --token) token=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    *) echo "migrate_sessions: unknown argument $1" >&2; exit 2 ;;
  esac
done
auth=()
[[ -n $token ]] && auth=(-H "Authorization: Bearer $token")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

list=$(curl -sS --fail-with-body "${auth[@]}" "$from/v1/sessions") || {
  echo "migrate_sessions: cannot list the sessions of $from: $list" >&2
  exit 1
}
# Session ids are [A-Za-z0-9_-]: the list's "id" fields, no JSON parser needed.
mapfile -t ids < <(grep -oE '"id":"[A-Za-z0-9_-]+"' <<<"$list" | cut -d'"' -f4)
moved=0 failed=0
for id in "${ids[@]}"; do
  snap=$work/$id.snapshot
  if ! code=$(curl -sS "${auth[@]}" -o "$snap" -w '%{http_code}' \
      "$from/v1/sessions/$id/snapshot") || [[ $code != 200 ]]; then
    echo "migrate_sessions: $id: export from $from: HTTP $code $(head -c 300 "$snap")" >&2
    failed=$((failed + 1))
    continue
  fi
  if ! code=$(curl -sS "${auth[@]}" -X PUT -H 'Content-Type: application/octet-stream' \
      -H "x-session-id: $id" --data-binary @"$snap" -o "$work/put" -w '%{http_code}' \
      "$to/v1/sessions/$id/snapshot") || [[ $code != 200 ]]; then
    echo "migrate_sessions: $id: import into $to: HTTP $code $(head -c 300 "$work/put")" >&2
    failed=$((failed + 1))
    continue
  fi
  if [[ $keep == 0 ]]; then
    curl -sS --fail-with-body "${auth[@]}" -X DELETE "$from/v1/sessions/$id" >/dev/null ||
      echo "migrate_sessions: $id: moved, but not deleted on $from" >&2
  fi
  moved=$((moved + 1))
  echo "migrate_sessions: $id: $(stat -c %s "$snap") bytes"
done
echo "migrate_sessions: $moved moved, $failed failed"
[[ $failed == 0 ]]
