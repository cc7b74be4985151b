#!/usr/bin/env bash
# Builds the GPU tests and benchmarks here and packs them, with the shared libraries a CUDA image
# lacks (Abseil, OpenBLAS, libgomp, ...), into gpu-bundle/ for a machine that has a GPU but not
# this project's Debian packages (the lent H100/H200 machines: CUDA, CMake and nvcc, no gRPC or
# Abseil), and packs that as gpu-bundle.tar.xz. There, scripts/gpu_run.sh unpacks it and runs
# everything in one call. CUDA's own libraries (cudart, cuBLAS) are left out: the GPU machine's
# toolkit provides them.
#   scripts/gpu_bundle.sh [build-dir]      (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bundle=gpu-bundle

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSUBSPACE_CUDA=ON >/dev/null
tests=(compress_blocks_test decode_attention_test layer_ops_test prefill_attention_test
       cuda_model_test cuda_model_cache_test cuda_model_ops_test device_info_test expand_blocks_test
       outlier_tokens_test recode_blocks_test transform_blocks_test)
[[ -f tests/kernels/sampling_test.cc ]] && tests+=(sampling_test)
benches=(subspace-bench-decode-attention subspace-bench-cpu)
# subspace-bench-cpu reaches the CUDA backend as the server does, through the plugin beside it.
cmake --build "$build" -j "$(nproc)" --target "${tests[@]}" "${benches[@]}" subspace_cuda \
  subspace-calibrate

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
for t in "${tests[@]}"; do cp "$build/tests/$t" "$bundle/bin/"; done
for b in "${benches[@]}"; do cp "$build/bin/$b" "$bundle/bin/"; done
cp "$build/bin/libsubspace_cuda.so" "$bundle/bin/"
# Transform codecs for the tiny model (2.5 / 1.5 bits, fitted on its own text, ~30 s each
# here), keys before RoPE and after it: gpu_run.sh measures the transform-coded cache with both.
"$build/bin/subspace-calibrate" --model models/subspace-tiny.gguf --kv-budget 2.5 \
  --kv-budget-v 1.5 --max-tokens 4000 --out "$bundle/tiny.codec.gguf" >/dev/null
"$build/bin/subspace-calibrate" --model models/subspace-tiny.gguf --kv-budget 2.5 \
  --kv-budget-v 1.5 --max-tokens 4000 --codec-post-rope --out "$bundle/tiny.post.codec.gguf" \
  >/dev/null
# Every resolved library but glibc's, the C++ runtime (the GPU image's is newer) and CUDA's.
for f in "$bundle"/bin/*; do
  ldd "$f" | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|\
    libcuda.so*|libcudart.so*|\
    libcublas*.so*) ;;
    *) cp -L "$lib" "$bundle/lib/" ;;
  esac
done
# Packed: the device tool carries at most 64 MiB with the working tree, and OpenBLAS alone is 36.
strip --strip-unneeded "$bundle"/bin/* 2>/dev/null || true
tar -cJf "$bundle.tar.xz" "$bundle"
du -sh "$bundle" "$bundle.tar.xz"
echo "carry: $bundle.tar.xz (then run scripts/gpu_run.sh on the GPU machine; it unpacks it)"
