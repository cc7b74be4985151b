// Times ggml's CPU matrix-vector product (ggml_mul_mat, the op llama.cpp's decode runs for
// every weight matrix) for one weight type and shape, so bench/quant_bench.sh can print it next
// to subspace-bench-matmul on the same machine, shapes, thread count and DRAM-resident weights.
// Not part of the build: linked against a ggml snapshot outside the repository
// (tools/ggml_ref/build.sh).
//
//   subspace-ggml-matvec_bench TYPE ROWSxCOLS THREADS [N]
//
// Prints one line: type, shape, n, microseconds per call, GB/s of weight bytes.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static double Now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s TYPE ROWSxCOLS THREADS [N]\n", argv[0]);
    return 2;
  }
  enum ggml_type type = GGML_TYPE_COUNT;
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    const char* name = ggml_type_name((enum ggml_type)t);
    if (name && strcmp(name, argv[1]) == 0) type = (enum ggml_type)t;
  }
  long rows = 0, cols = 0;
  if (type == GGML_TYPE_COUNT || sscanf(argv[2], "%ldx%ld", &rows, &cols) != 2) {
    fprintf(stderr, "bad type or shape\n");
    return 2;
  }
  const int threads = atoi(argv[3]);
  const int n = argc > 4 ? atoi(argv[4]) : 1;
  ggml_cpu_init();
  const size_t matrix_bytes = ggml_row_size(type, cols) * (size_t)rows;
  // Enough copies to pass 256 MiB, cycled, so the weights come from DRAM as in a real model.
  const int copies = (int)((256u << 20) / matrix_bytes + 1);
  const size_t ctx_bytes = (size_t)copies * (matrix_bytes + 1024) + (size_t)n * cols * 4 +
                           (size_t)copies * n * rows * 4 + (64u << 20);
  struct ggml_init_params params = {.mem_size = ctx_bytes, .mem_buffer = NULL, .no_alloc = false};
  struct ggml_context* ctx = ggml_init(params);
  float* values = malloc(sizeof(float) * (size_t)cols * rows);
  uint64_t state = 1;
  for (long i = 0; i < cols * rows; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    values[i] = ((float)(state >> 40) / (float)(1 << 24) - 0.5f) * 0.04f;
  }
  struct ggml_tensor* x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, cols, n);
  for (long i = 0; i < cols * n; ++i) ((float*)x->data)[i] = values[i % (cols * rows)] * 25.0f;
  struct ggml_cgraph** graphs = malloc(sizeof(*graphs) * copies);
  const void* first = NULL;
  for (int c = 0; c < copies; ++c) {
    struct ggml_tensor* w = ggml_new_tensor_2d(ctx, type, cols, rows);
    if (c == 0) {
      first = w->data;
      if (type == GGML_TYPE_F32) {
        memcpy(w->data, values, matrix_bytes);
      } else if (type == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(values, w->data, cols * rows);
      } else {
        ggml_quantize_chunk(type, values, w->data, 0, rows, cols, NULL);
      }
    } else {
      memcpy(w->data, first, matrix_bytes);
    }
    graphs[c] = ggml_new_graph(ctx);
    ggml_build_forward_expand(graphs[c], ggml_mul_mat(ctx, w, x));
  }
  for (int c = 0; c < copies; ++c) ggml_graph_compute_with_ctx(ctx, graphs[c], threads);  // warm
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    int calls = 0;
    const double start = Now();
    while (Now() - start < 0.3 || calls < 2) {
      ggml_graph_compute_with_ctx(ctx, graphs[calls % copies], threads);
      ++calls;
    }
    const double per_call = (Now() - start) / calls;
    if (per_call < best) best = per_call;
  }
  printf("%-7s %6ldx%-6ld n=%-4d %10.1f us %8.2f GB/s\n", argv[1], rows, cols, n, best * 1e6,
         matrix_bytes / best / 1e9);
  return 0;
}
