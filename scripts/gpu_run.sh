#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu_bundle.sh packed
# gpu-bundle/ here: every GPU test (each kernel against its CPU twin, the CUDA backend against
# the CPU backend), compute-sanitizer memcheck on the backend test and memcheck + racecheck on a
# slice of each kernel suite, then the benchmarks (decode attention against the copy bandwidth,
# end-to-end decode on the tiny model and on a random-weight 1 B model). Every step has a time
# limit so that one call fits a lease. Logs go to a folder, packed as $OUT/gpu-logs.tar.gz (the
# device tool returns at most 8 files); the summary table prints last and lands in
# $OUT/summary.txt.
#   scripts/gpu_run.sh [--quick]     (--quick: tests and memcheck only, no benchmarks)
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-gpu-out}
out=$(mktemp -d /tmp/gpu-logs.XXXXXX)
mkdir -p "$dest"
bundle=gpu-bundle
[[ -d $bundle ]] || tar -xJf "$bundle.tar.xz" || { echo "no $bundle: run scripts/gpu_bundle.sh here first"; exit 1; }
export LD_LIBRARY_PATH="$PWD/$bundle/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
export SUBSPACE_TEST_MODEL="$PWD/models/subspace-tiny.gguf"
quick=${1:-}
summary=()
t0=$SECONDS
deadline=${GPU_RUN_SECONDS:-480}  # the whole run; steps past it are skipped, one is cut short
note() { summary+=("$(printf '%-34s %4ds  %s' "$1" "$((SECONDS - t0))" "$2")"); }
# lim N CMD...: runs CMD for at most N seconds and no later than the deadline (rc 124 if cut).
lim() {
  local left=$((deadline - SECONDS + t0)) n=$1
  shift
  ((left < 5)) && return 125  # skipped
  ((n > left)) && n=$left
  timeout "$n" "$@"
}

{ nvidia-smi || true; date -u; } >"$out/device.txt" 2>&1
for t in "$bundle"/bin/*_test; do
  name=$(basename "$t")
  lim 120 "$t" --gtest_brief=1 >"$out/$name.log" 2>&1
  note "$name" "rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/$name.log" | tr '\n' ' ')"
done

sanitizer=$(command -v compute-sanitizer || true)
source scripts/kernel_slices.sh
san() {  # tool, name, binary, gtest filter
  lim "$5" "$sanitizer" --tool "$1" --error-exitcode 99 "$bundle/bin/$3" \
    --gtest_brief=1 --gtest_filter="$4" >"$out/$1-$2.log" 2>&1
  note "$1 $2" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$1-$2.log" | tail -1)"
}
sanitize_slices() {  # tool, seconds per slice
  for slice in "${kernel_slices[@]}"; do
    read -r name binary filter <<<"$slice"
    [[ $1 == memcheck && $binary == cuda_model_test ]] && continue  # whole, above
    [[ -x $bundle/bin/$binary ]] && san "$1" "$name" "$binary" "$filter" "$2"
  done
}
if [[ -n $sanitizer ]]; then
  san memcheck cuda_model cuda_model_test 'CudaModelTest.*:Families/CudaModelFamilyTest.*' 120
  sanitize_slices memcheck 60
else
  note "compute-sanitizer" "not found"
fi

if [[ $quick != --quick ]]; then
  bench=$bundle/bin/subspace-bench-cpu
  lim 120 "$bundle/bin/subspace-bench-decode-attention" >"$out/bench-decode-attention.md" 2>&1
  note "bench decode attention fp16" "rc=$?"
  lim 120 "$bundle/bin/subspace-bench-decode-attention" --coeff int8 \
    >"$out/bench-decode-attention-int8.md" 2>&1
  note "bench decode attention int8" "rc=$?"
  # The server asks for 8 CTAs per SM since 2026-11-28 (2 gave 0.29 waves per SM); 2 for
  # comparison.
  lim 120 "$bundle/bin/subspace-bench-decode-attention" --ctas_per_sm 2 \
    >"$out/bench-decode-attention-2ctas.md" 2>&1
  note "bench decode attention 2 CTAs/SM" "rc=$?"
  # Both caches in one run: per-kind rows, then compressed/full decode speedup next to bytes.
  lim 90 "$bench" --device cuda --kv-cache full,compressed --batch 1,16,64 \
    --prompt-tokens 128 --decode-tokens 128 >"$out/bench-generate-cuda.md" 2>&1
  note "bench generate cuda (tiny)" "rc=$?"
  # The same without CUDA graphs: what replaying decode steps as graphs gains.
  lim 90 "$bench" --device cuda --cuda-graphs=false --kv-cache full,compressed \
    --batch 1,16,64 --prompt-tokens 128 --decode-tokens 128 >"$out/bench-generate-cuda-eager.md" 2>&1
  note "bench generate cuda eager (tiny)" "rc=$?"
  # The transform-coded cache (issue 36) beside the full one: keys coded before RoPE (decoded
  # into rows every step), then after it (read in code space, as the values always are).
  if [[ -f $bundle/tiny.codec.gguf ]]; then
    lim 90 "$bench" --device cuda --kv-cache full,transform --codec "$bundle/tiny.codec.gguf" \
      --batch 1,16,64 --prompt-tokens 384 --decode-tokens 64 >"$out/bench-generate-cuda-transform.md" 2>&1
    note "bench generate cuda transform (tiny)" "rc=$?"
  fi
  if [[ -f $bundle/tiny.post.codec.gguf ]]; then
    lim 90 "$bench" --device cuda --kv-cache full,transform --codec "$bundle/tiny.post.codec.gguf" \
      --batch 1,16,64 --prompt-tokens 384 --decode-tokens 64 \
      >"$out/bench-generate-cuda-transform-post.md" 2>&1
    note "bench generate cuda transform post-RoPE (tiny)" "rc=$?"
  fi
  # A 1 B-parameter random-weight model (Llama 3.2 1B's shape), written here: too big to carry.
  m1b=/tmp/random-llama-1b.gguf
  lim 120 python3 bench/make_random_llama.py --out "$m1b" --preset 1b >"$out/make-1b.log" 2>&1
  note "random 1B model" "rc=$?"
  for spec in "2048 1,16,64" "8192 1,16"; do
    read -r ctx batches <<<"$spec"
    for graphs in true false; do
      log=$out/bench-generate-cuda-1b-ctx$ctx-graphs-$graphs.md
      lim 150 "$bench" --model "$m1b" --device cuda --cuda-graphs=$graphs \
        --kv-cache full,compressed --batch "$batches" --prompt-tokens "$ctx" --decode-tokens 64 \
        --repeats 1 --kv-cache-bytes $((24 << 30)) >"$log" 2>&1
      note "bench 1B ctx $ctx graphs=$graphs" "rc=$?"
      [[ $ctx == 8192 ]] && break  # graphs vs eager once, at 2k
    done
  done
  # One batch-1 decode step at 2k, kernel by kernel (issue 32): Nsight Compute times every
  # launch alone; scripts/ncu_step_table.py picks each cache's last decode step.
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [[ -n $ncu && -f $m1b ]]; then
    lim 150 "$ncu" --clock-control none --csv --page raw --log-file "$out/ncu-step.csv" \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      "$bench" --model "$m1b" --device cuda --kv-cache full,compressed --batch 1 \
      --prompt-tokens 2048 --decode-tokens 3 --repeats 1 >"$out/ncu-step-app.log" 2>&1
    note "ncu 1B decode step" "rc=$?"
    copy=$(grep -oE '[0-9]+ GB/s read \+ write' "$out/bench-decode-attention.md" | grep -oE '^[0-9]+')
    # The bytes of weights a decode step reads (all but the embedding table), as the 2k bench
    # counted them.
    mb=$(grep -oE 'decode weight reads \(full, batch 1\): [0-9.]+' \
      "$out/bench-generate-cuda-1b-ctx2048-graphs-false.md" | grep -oE '[0-9.]+$')
    python3 scripts/ncu_step_table.py "$out/ncu-step.csv" --labels full,compressed \
      --weight-bytes "$(python3 -c "print(${mb:-0} * 1e6)")" --copy-gbps "${copy:-0}" \
      >"$out/decode-step-profile.md" 2>&1
    note "decode step table" "rc=$?"
    cp "$out/decode-step-profile.md" "$dest/"
  else
    note "ncu 1B decode step" "skipped (ncu: ${ncu:-none})"
  fi
fi

# Racecheck last: the slowest tool, it gets what time is left.
[[ -n $sanitizer ]] && sanitize_slices racecheck 60

printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
cp "$out/summary.txt" "$dest/"
tar -C "$out" -czf "$dest/gpu-logs.tar.gz" .
