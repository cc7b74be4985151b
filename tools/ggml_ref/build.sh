#!/usr/bin/env bash
# Builds the reference-vector generator and the ggml quantizer (quantize_gguf.c) against a ggml snapshot kept OUTSIDE this repository
# and regenerates tests/data/quants/. Nothing of ggml is committed: only the numbers it
# produces, with the snapshot's commit recorded in tests/data/quants/SOURCE.md.
#
#   tools/ggml_ref/build.sh /path/to/ggml-checkout [/path/to/build-dir]
#
# The checkout: https://github.com/ggml-org/ggml (the library inside llama.cpp).
set -euo pipefail
src=${1:?usage: build.sh GGML_SRC [BUILD_DIR]}
build=${2:-$src/build}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
if [[ ! -f $build/src/libggml-cpu.a ]]; then
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_BUILD_EXAMPLES=OFF -DGGML_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$build" -j"$(nproc)"
fi
libs=("$build/src/libggml-cpu.a" "$build/src/libggml-base.a" -lstdc++ -lm -lpthread -fopenmp)
for tool in quant_vectors quantize_gguf matvec_bench; do
  cc -O2 -std=c11 -I"$src/include" "$here/$tool.c" "${libs[@]}" -o "$build/subspace-ggml-$tool"
done
if [[ ${SKIP_VECTORS:-0} != 1 ]]; then
  mkdir -p "$repo/tests/data/quants"
  "$build/subspace-ggml-quant_vectors" "$repo/tests/data/quants"
fi
echo "quantizer: $build/subspace-ggml-quantize_gguf IN.gguf OUT.gguf TYPE|q4_K_M"
