# Sourced by gpu_run.sh and sanitize.sh: a short slice of each kernel test suite, its boundary
# shapes (smallest and largest head_dim / block size / rank, misaligned and odd sizes, the
# refusals). On a GPU they run under compute-sanitizer memcheck; on the CPU, emulated
# (tests/cuda_emu/), under ASan + UBSan. Each entry: name, test binary, gtest filter.
kernel_slices=(
  "layer_ops layer_ops_test *ScalarTest*:*Bad*:*/d128_b64_n70_kv8_misaligned"
  "prefill prefill_attention_test *LimitsTest*:*/d64_b1_n3_q5_g2:*/d128_b64_n1_q64_g4"
  "decode decode_attention_test *LimitsTest*:*/d64_b8_n1_r8_fp16:*/d128_b32_n32_r32_int8:*TransformGpuTest*/0:*TransformGpuTest*/1"
  "compress compress_blocks_test *LimitsTest*:*/d64_b8_n1_r8_fp16:*/d128_b64_rfull_int8"
  "expand expand_blocks_test *LimitsTest*:*/d64_b1_r1_fp16_scratch:*/d128_b64_rfull_int8_onepool"
  "outliers outlier_tokens_test *d64_b16*:*d128_b64*"
  "transform transform_blocks_test *LaunchTest*:*/d64_b5_prerope_halves_rot32_mscale:*/d128_b64_prerope"
  "recode recode_blocks_test *LimitsTest*:*/d64_b8_n1_r8_fp16:*/d128_b32_n32_r32_int8"
  "sampling sampling_test *LimitsTest*:*/v7_normal"
  "backend cuda_model_test CudaModelTest.AllLogitsRowsMatch:CudaModelTest.Rejects*:CudaModelTest.Takes*"
)
