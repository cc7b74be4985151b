#!/usr/bin/env bash
# Installs everything the build, the tests and the demo need from Debian packages.
# Idempotent: installs only what is missing and stays quiet when all is present.
set -euo pipefail

#   scripts/setup.sh         everything: build, tests, tools, the model recipe
#   scripts/setup.sh build   what building the server and the client needs (the Docker image)
BUILD_PACKAGES=(
  cmake ninja-build g++ pkg-config git
  libabsl-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libssl-dev
  libspdlog-dev libfmt-dev prometheus-cpp-dev libgtest-dev libgmock-dev
  libopenblas-dev libopenblas0-pthread
  libcpp-httplib-dev nlohmann-json3-dev libzstd-dev zlib1g-dev
)
PACKAGES=("${BUILD_PACKAGES[@]}"
  python3 python3-numpy python3-torch python3-sentencepiece python3-grpcio python3-matplotlib
  prometheus curl openssl
  nginx python3-yaml python3-regex python3-jinja2
  clang libclang-rt-14-dev libomp-dev clang-format clang-tidy pyflakes3
  ccache
)
if [ "${1:-}" = "build" ]; then PACKAGES=("${BUILD_PACKAGES[@]}"); fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# torch and our matmuls are ~35x slower with the reference BLAS: prefer OpenBLAS (pthreads).
blas_alt=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [ -e "$blas_alt" ] && command -v update-alternatives >/dev/null; then
  current=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
  if [ "$current" != "$blas_alt" ]; then
    update-alternatives --set libblas.so.3-x86_64-linux-gnu "$blas_alt" >/dev/null 2>&1 || true
  fi
fi

# The HTTP API's client test runs OpenAI's official Node client (tests/http/package-lock.json
# pins it). Node comes from Debian when the machine has none.
if [ "${1:-}" != "build" ]; then
  if ! command -v npm >/dev/null; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      nodejs npm >/dev/null
  fi
  http_tests="$(dirname "$0")/../tests/http"
  # The stamp is the lock file the last install used.
  if ! cmp -s "$http_tests/package-lock.json" "$http_tests/node_modules/.subspace-lock"; then
    echo "setup: installing the HTTP API test's npm packages (tests/http)"
    npm ci --prefix "$http_tests" --no-audit --no-fund --silent
    cp "$http_tests/package-lock.json" "$http_tests/node_modules/.subspace-lock"
  fi
fi
