// Quantizes a GGUF model's weight matrices with ggml's quantizer (ggml_quantize_chunk, the
// function llama.cpp's llama-quantize calls), for benchmarks and end-to-end checks of the
// quantized types when llama.cpp itself is not at hand. Not part of the build: linked against a
// ggml snapshot outside the repository by tools/ggml_ref/build.sh.
//
//   subspace-ggml-quantize IN.gguf OUT.gguf TYPE
//
// TYPE is a ggml type name (q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl)
// or the mixture q4_K_M, which follows llama-quantize's recipe as documented for Q4_K_M:
// output.weight q6_K; attn_v and ffn_down q6_K in the first and last eighth of the layers and
// every third layer between, q4_K elsewhere. Whatever the type, 1-D tensors stay as they are,
// and a matrix whose rows are not whole blocks of the type falls back as llama-quantize does
// (q4_K -> q5_0, q5_K -> q5_1, q6_K -> q8_0, q2_K / q3_K -> iq4_nl).
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf.h"

static enum ggml_type TypeByName(const char* name) {
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    const char* n = ggml_type_name((enum ggml_type)t);
    if (n && strcmp(n, name) == 0) return (enum ggml_type)t;
  }
  return GGML_TYPE_COUNT;
}

static enum ggml_type Fallback(enum ggml_type type) {
  switch (type) {
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K:
      return GGML_TYPE_IQ4_NL;
    case GGML_TYPE_Q4_K:
      return GGML_TYPE_Q5_0;
    case GGML_TYPE_Q5_K:
      return GGML_TYPE_Q5_1;
    case GGML_TYPE_Q6_K:
      return GGML_TYPE_Q8_0;
    default:
      return type;
  }
}

static bool UseMoreBits(int layer, int layers) {
  return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
}

// blk.N.xxx -> N; -1 otherwise.
static int LayerOf(const char* name) {
  int layer = -1;
  return sscanf(name, "blk.%d.", &layer) == 1 ? layer : -1;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s IN.gguf OUT.gguf TYPE|q4_K_M\n", argv[0]);
    return 2;
  }
  const bool q4_k_m = strcmp(argv[3], "q4_K_M") == 0;
  const enum ggml_type base = q4_k_m ? GGML_TYPE_Q4_K : TypeByName(argv[3]);
  if (base == GGML_TYPE_COUNT) {
    fprintf(stderr, "unknown type %s\n", argv[3]);
    return 2;
  }
  ggml_cpu_init();
  struct ggml_context* ctx = NULL;
  struct gguf_init_params params = {.no_alloc = false, .ctx = &ctx};
  struct gguf_context* in = gguf_init_from_file(argv[1], params);
  if (!in) {
    fprintf(stderr, "cannot read %s\n", argv[1]);
    return 1;
  }
  int layers = 0;
  const int64_t arch_key = gguf_find_key(in, "general.architecture");
  if (arch_key >= 0) {
    char key[256];
    snprintf(key, sizeof(key), "%s.block_count", gguf_get_val_str(in, arch_key));
    const int64_t k = gguf_find_key(in, key);
    if (k >= 0) layers = (int)gguf_get_val_u32(in, k);
  }
  struct gguf_context* out = gguf_init_empty();
  gguf_set_kv(out, in);
  gguf_set_val_u32(out, "general.file_type", 0);  // not one of llama.cpp's ftype ids; unused here
  const int64_t n_tensors = gguf_get_n_tensors(in);
  void** buffers = calloc((size_t)n_tensors, sizeof(void*));
  size_t bytes_in = 0, bytes_out = 0;
  for (int64_t i = 0; i < n_tensors; ++i) {
    const char* name = gguf_get_tensor_name(in, i);
    struct ggml_tensor* t = ggml_get_tensor(ctx, name);
    gguf_add_tensor(out, t);
    bytes_in += ggml_nbytes(t);
    enum ggml_type type = base;
    if (q4_k_m) {
      const int layer = LayerOf(name);
      if (strcmp(name, "output.weight") == 0) type = GGML_TYPE_Q6_K;
      if ((strstr(name, "attn_v.weight") || strstr(name, "ffn_down.weight")) && layer >= 0 &&
          UseMoreBits(layer, layers)) {
        type = GGML_TYPE_Q6_K;
      }
    }
    const bool matrix = ggml_n_dims(t) == 2 && t->type != type;
    if (!matrix || (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 &&
                    t->type != GGML_TYPE_BF16)) {
      bytes_out += ggml_nbytes(t);
      continue;
    }
    if (t->ne[0] % ggml_blck_size(type) != 0) type = Fallback(type);
    if (t->ne[0] % ggml_blck_size(type) != 0) {
      bytes_out += ggml_nbytes(t);
      continue;
    }
    const int64_t n = ggml_nelements(t);
    float* f32 = malloc(sizeof(float) * (size_t)n);
    if (t->type == GGML_TYPE_F32) {
      memcpy(f32, t->data, sizeof(float) * (size_t)n);
    } else {
      ggml_get_type_traits(t->type)->to_float(t->data, f32, n);
    }
    const size_t size = ggml_row_size(type, t->ne[0]) * (size_t)(n / t->ne[0]);
    buffers[i] = malloc(size);
    ggml_quantize_chunk(type, f32, buffers[i], 0, n / t->ne[0], t->ne[0], NULL);
    free(f32);
    gguf_set_tensor_type(out, name, type);
    gguf_set_tensor_data(out, name, buffers[i]);
    bytes_out += size;
    printf("%-28s %-6s -> %s\n", name, ggml_type_name(t->type), ggml_type_name(type));
  }
  if (!gguf_write_to_file(out, argv[2], false)) {
    fprintf(stderr, "cannot write %s\n", argv[2]);
    return 1;
  }
  printf("%s: %.2f MiB -> %.2f MiB\n", argv[2], bytes_in / 1048576.0, bytes_out / 1048576.0);
  return 0;
}
