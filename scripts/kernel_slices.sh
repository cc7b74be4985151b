# Sourced by gpu_run.sh and sanitize.sh: a short slice of each kernel test suite, its boundary
# shapes (smallest and largest head_dim / block size, odd sizes, the refusals). On a GPU they run
# under compute-sanitizer memcheck; on the CPU, emulated (tests/cuda_emu/), under ASan + UBSan.
# Each entry: name, test binary, gtest filter.
kernel_slices=(
  "layer_ops layer_ops_test */0:*/7:*Bad*"
  "prefill prefill_attention_test */0:*/5:*/100:*Odd*"
  "decode decode_attention_test */0:*/9:*/31"
  "compress compress_blocks_test */0:*/3"
  "expand expand_blocks_test */0:*/3"
  "outliers outlier_tokens_test *d64_b16*:*d128_b64*"
  "recode recode_blocks_test */0:*/3:*Largest*"
  "sampling sampling_test */0:*/3"
)
