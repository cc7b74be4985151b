#!/usr/bin/env bash
# Builds tools/llama_ref/logits.c against a llama.cpp checkout and build kept OUTSIDE this
# repository (cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF; the tests' numbers came from commit
# c392e509), then regenerates tests/data/llamacpp/: small random-weight GGUFs of each
# architecture llama.cpp knows, written by tests/reference/make_reference.py, and llama.cpp's
# logits and greedy tokens for them. Nothing of llama.cpp is committed, only its numbers.
#
#   tools/llama_ref/build.sh /path/to/llama.cpp [/path/to/its/build] [COMMIT]
set -euo pipefail
src=${1:?usage: build.sh LLAMA_SRC [LLAMA_BUILD]}
build=${2:-$src/build}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cc -O2 -std=c11 -I"$src/include" -I"$src/ggml/include" "$here/logits.c" \
  -L"$build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$build/subspace-llama-logits"
/usr/bin/python3 "$repo/tests/reference/make_llamacpp_fixtures.py" \
  --logits-tool "$build/subspace-llama-logits" --out "$repo/tests/data/llamacpp" \
  --llama-commit "${3:-$(git -C "$src" rev-parse --short=8 HEAD 2>/dev/null || echo unknown)}"
