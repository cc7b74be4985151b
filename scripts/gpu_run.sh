#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu_bundle.sh packed
# gpu-bundle/ here: every GPU test (each kernel against its CPU twin, the CUDA backend against
# the CPU backend), compute-sanitizer memcheck on the backend test and a slice of each kernel
# suite, then the benchmarks. Logs go to $OUT (or gpu-out/); a summary table prints last.
#   scripts/gpu_run.sh [--quick]     (--quick: tests and memcheck only, no benchmarks)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
bundle=gpu-bundle
export LD_LIBRARY_PATH="$PWD/$bundle/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
export SUBSPACE_TEST_MODEL="$PWD/models/subspace-tiny.gguf"
quick=${1:-}
summary=()

{ nvidia-smi || true; date -u; } >"$out/device.txt" 2>&1
for t in "$bundle"/bin/*_test; do
  name=$(basename "$t")
  "$t" --gtest_brief=1 >"$out/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-28s rc=%d  %s' "$name" "$rc" "$(grep -E '^\[  (PASSED|FAILED)' "$out/$name.log" | tr '\n' ' ')")")
done

if command -v compute-sanitizer >/dev/null; then
  san() {  # name, binary, gtest filter
    compute-sanitizer --tool memcheck --error-exitcode 99 "$bundle/bin/$2" --gtest_brief=1 \
      --gtest_filter="$3" >"$out/memcheck-$1.log" 2>&1
    summary+=("$(printf '%-28s rc=%d  %s' "memcheck $1" "$?" "$(grep -E 'ERROR SUMMARY' "$out/memcheck-$1.log" | tail -1)")")
  }
  san cuda_model cuda_model_test '*'
  source scripts/kernel_slices.sh
  for slice in "${kernel_slices[@]}"; do
    read -r name binary filter <<<"$slice"
    [[ $binary == cuda_model_test ]] && continue  # whole, above
    [[ -x $bundle/bin/$binary ]] && san "$name" "$binary" "$filter"
  done
else
  summary+=("compute-sanitizer not found")
fi

if [[ $quick != --quick ]]; then
  "$bundle/bin/subspace-bench-decode-attention" >"$out/bench-decode-attention.md" 2>&1
  summary+=("bench decode attention rc=$?")
  # Both caches in one run: per-kind rows, then compressed/full decode speedup next to bytes.
  "$bundle/bin/subspace-bench-cpu" --device cuda --kv-cache full,compressed --batch 1,16,64 \
    --prompt-tokens 128 --decode-tokens 128 >"$out/bench-generate-cuda.md" 2>&1
  summary+=("bench generate cuda rc=$?")
  # The same without CUDA graphs: what replaying decode steps as graphs gains.
  "$bundle/bin/subspace-bench-cpu" --device cuda --cuda-graphs=false --kv-cache full,compressed \
    --batch 1,16,64 --prompt-tokens 128 --decode-tokens 128 >"$out/bench-generate-cuda-eager.md" 2>&1
  summary+=("bench generate cuda eager rc=$?")
  "$bundle/bin/subspace-bench-cpu" --device cpu --kv-cache full,compressed --batch 1,16,64 \
    --prompt-tokens 128 --decode-tokens 128 >"$out/bench-generate-cpu.md" 2>&1
  summary+=("bench generate cpu rc=$?")
fi

printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
