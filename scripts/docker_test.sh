#!/usr/bin/env bash
# Builds the CPU image (Dockerfile) and runs it: the container turns healthy (its HEALTHCHECK,
# gRPC health), runs as a non-root user, answers a Generate from the client inside it, and on
# SIGTERM drains and exits 0. CI runs this after the test suite.
#
# Needs a Docker engine: Debian's docker.io, started here when none answers (vfs storage, no
# bridge, no iptables: what these machines allow; the container shares the host's network). When
# the registry cannot be reached, the Debian 12 base is made with debootstrap and `docker import`
# and kept as $BASE_IMAGE for later runs on the same engine.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-subspace:cpu}
BASE_IMAGE=${BASE_IMAGE:-subspace-base/debian:12}
PORT=${PORT:-50051}  # the HEALTHCHECK probes 50051
HTTP_PORT=${HTTP_PORT:-18080}
NAME=subspace-docker-test-$$

log() { echo "docker_test: $*"; }
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if ((${#need[@]})); then
  log "installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  nohup dockerd --storage-driver=vfs --bridge=none --iptables=false >/tmp/subspace-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { cat /tmp/subspace-dockerd.log; exit 1; }
fi

build_args=()
if timeout 60 docker pull -q debian:12 >/dev/null 2>&1 &&
   timeout 60 docker pull -q debian:12-slim >/dev/null 2>&1; then
  log "base images pulled from the registry"
else
  if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "no registry: making $BASE_IMAGE with debootstrap"
    rootfs=$(mktemp -d /var/tmp/subspace-rootfs.XXXXXX)
    chmod 755 "$rootfs"  # it becomes the image's /: mktemp's 0700 would lock out non-root users
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . |
      docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
  fi
  build_args=(--build-arg "BUILD_BASE=$BASE_IMAGE" --build-arg "RUN_BASE=$BASE_IMAGE")
fi

log "building $IMAGE"
start=$(date +%s)
build_log=$(mktemp /tmp/subspace-docker-build.XXXXXX.log)
if ! docker build --network=host -t "$IMAGE" "${build_args[@]}" . >"$build_log" 2>&1; then
  tail -40 "$build_log"; exit 1
fi
log "built in $(($(date +%s) - start)) s: $(docker image inspect -f '{{.Size}}' "$IMAGE") bytes"

cleanup() { docker rm -f "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT
docker run -d --name "$NAME" --network=host "$IMAGE" \
  --model=/opt/subspace/models/subspace-long.gguf --port="$PORT" --metrics-port=-1 --http-port="$HTTP_PORT" \
  --drain-seconds=20 >/dev/null

status=""
for _ in $(seq 120); do
  status=$(docker inspect -f '{{.State.Health.Status}}' "$NAME")
  [ "$status" = healthy ] && break
  [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" = true ] || break
  sleep 1
done
if [ "$status" != healthy ]; then
  log "container not healthy ($status)"; docker logs "$NAME"; exit 1
fi
log "healthy"
uid=$(docker exec "$NAME" id -u)
[ "$uid" != 0 ] || { log "runs as root"; exit 1; }
out=$(docker exec "$NAME" subspace --server="127.0.0.1:$PORT" generate \
  --prompt "In the beginning" --max-new-tokens 8)
echo "$out"
[ -n "$out" ] || { log "empty generation"; exit 1; }
# The OpenAI-compatible HTTP API of the same server (from the host: --network=host).
http_out=$(curl -sf "http://127.0.0.1:$HTTP_PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "subspace-long", "prompt": "In the beginning", "max_tokens": 8}')
echo "$http_out"
grep -q '"object":"text_completion"' <<<"$http_out" || { log "HTTP API: no completion"; exit 1; }
# The long-context model's codec ships beside it and is served by default (--kv-cache auto).
# (The log is read whole first: with pipefail, `docker logs | grep -q` fails whenever grep stops
# reading before docker has written everything, and docker logs writes in several pieces.)
logs=$(docker logs "$NAME" 2>&1)
grep -q 'codec file /opt/subspace/models/subspace-long.codec loaded' <<<"$logs" ||
  { log "the model's codec file was not loaded"; echo "$logs"; exit 1; }

docker stop -t 40 "$NAME" >/dev/null
rc=$(docker inspect -f '{{.State.ExitCode}}' "$NAME")
docker logs "$NAME" 2>&1 | tail -3
[ "$rc" = 0 ] || { log "exit code $rc after SIGTERM"; exit 1; }
log "ok: healthy as uid $uid, codec loaded, generated over gRPC and HTTP, drained on SIGTERM with exit 0"
