// Writes reference vectors for the GGUF tensor types: for each type, a few rows of seeded
// values quantized by ggml's own quantizer, ggml's dequantization of those bytes, an
// activation row quantized to the type's dot-product partner (q8_0 / q8_1 / q8_K) by ggml's
// CPU backend, and ggml's CPU dot products of each row with it. The tests check our
// dequantization and fused dot kernels against these numbers (tests/data/quants/).
//
// Not part of the build: it links a ggml snapshot from outside the repository
// (tools/ggml_ref/build.sh). Our code calling ggml's public API; none of ggml is copied.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml.h"

static uint64_t state = 0x9E3779B97F4A7C15ull;
static double Uniform(void) {  // splitmix64 -> [0, 1)
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (double)(z >> 11) / 9007199254740992.0;
}
static float Normal(void) {
  double u1 = Uniform(), u2 = Uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static void Write(FILE* f, const void* p, size_t bytes) {
  if (fwrite(p, 1, bytes, f) != bytes) {
    perror("fwrite");
    exit(1);
  }
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  ggml_cpu_init();
  const enum ggml_type types[] = {GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
                                  GGML_TYPE_Q8_0, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K,
                                  GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_IQ4_NL};
  const int rows = 4;
  const int n = 512;  // two 256-value super-blocks, sixteen 32-value blocks
  for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); ++t) {
    const enum ggml_type type = types[t];
    // Rows of different spread, a few outliers, one row with an all-zero block.
    float* x = malloc(sizeof(float) * rows * n);
    for (int r = 0; r < rows; ++r) {
      const float spread = 0.02f * (float)(r + 1);
      for (int i = 0; i < n; ++i) {
        float v = spread * Normal();
        if (Uniform() < 0.01) v *= 8.0f;
        x[r * n + i] = v;
      }
    }
    memset(x + 3 * n, 0, 32 * sizeof(float));
    float* act = malloc(sizeof(float) * n);
    for (int i = 0; i < n; ++i) act[i] = Normal() + 0.1f;

    const size_t row_bytes = ggml_row_size(type, n);
    uint8_t* q = malloc(row_bytes * rows);
    ggml_quantize_init(type);
    if (ggml_quantize_chunk(type, x, q, 0, rows, n, NULL) != row_bytes * rows) {
      fprintf(stderr, "quantize size mismatch for %s\n", ggml_type_name(type));
      return 1;
    }
    float* deq = malloc(sizeof(float) * rows * n);
    for (int r = 0; r < rows; ++r) {
      ggml_get_type_traits(type)->to_float(q + r * row_bytes, deq + r * n, n);
    }
    const struct ggml_type_traits_cpu* cpu = ggml_get_type_traits_cpu(type);
    const enum ggml_type act_type = cpu->vec_dot_type;
    const size_t act_bytes = ggml_row_size(act_type, n);
    uint8_t* aq = malloc(act_bytes);
    ggml_get_type_traits_cpu(act_type)->from_float(act, aq, n);
    float dot[4];
    for (int r = 0; r < rows; ++r) cpu->vec_dot(n, &dot[r], 0, q + r * row_bytes, 0, aq, 0, 1);

    char path[4096];
    snprintf(path, sizeof(path), "%s/%s.bin", argv[1], ggml_type_name(type));
    FILE* f = fopen(path, "wb");
    if (!f) {
      perror(path);
      return 1;
    }
    const uint32_t header[6] = {0x56515353u /* "SSQV" */, 1, (uint32_t)type, (uint32_t)act_type,
                                (uint32_t)rows, (uint32_t)n};
    const uint64_t sizes[2] = {row_bytes * rows, act_bytes};
    Write(f, header, sizeof(header));
    Write(f, sizes, sizeof(sizes));
    Write(f, x, sizeof(float) * rows * n);
    Write(f, q, row_bytes * rows);
    Write(f, deq, sizeof(float) * rows * n);
    Write(f, act, sizeof(float) * n);
    Write(f, aq, act_bytes);
    Write(f, dot, sizeof(float) * rows);
    fclose(f);
    printf("%-7s act %-5s row %5zu bytes  dots %+.6f %+.6f %+.6f %+.6f\n", ggml_type_name(type),
           ggml_type_name(act_type), row_bytes, dot[0], dot[1], dot[2], dot[3]);
    free(x), free(act), free(q), free(deq), free(aq);
  }
  return 0;
}
