/* Runs a GGUF model through llama.cpp's public API (libllama) and writes the logits of every
 * position of a token sequence, then the greedy continuation: reference values for our forward
 * pass on the same file (tests/data/llamacpp/). Built by tools/llama_ref/build.sh against a
 * llama.cpp checkout kept outside this repository; nothing of llama.cpp is committed.
 *
 *   subspace-llama-logits MODEL.gguf 1,2,3 OUT.f32 GREEDY_STEPS
 *
 * OUT.f32: little-endian float32 [n_tokens, n_vocab]. stdout: "greedy=ID,ID,...".
 * One thread, one sequence, a context of 256, an F32 KV cache: deterministic. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static int decode(struct llama_context* ctx, const llama_token* tokens, int n, int first_pos) {
  struct llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = tokens[i];
    batch.pos[i] = first_pos + i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = n;
  const int rc = llama_decode(ctx, batch);
  llama_batch_free(batch);
  return rc;
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s MODEL TOKENS OUT.f32 GREEDY_STEPS\n", argv[0]);
    return 2;
  }
  llama_token tokens[512];
  int n = 0;
  for (char* tok = strtok(argv[2], ","); tok != NULL && n < 512; tok = strtok(NULL, ",")) {
    tokens[n++] = atoi(tok);
  }
  const int steps = atoi(argv[4]);
  llama_backend_init();
  struct llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  struct llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == NULL) return 1;
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 256;
  cp.n_batch = 256;
  cp.n_ubatch = 256;
  cp.n_threads = 1;
  cp.n_threads_batch = 1;
  /* An F32 KV cache: llama.cpp's default F16 one rounds K and V (~1e-3 on the logits), which
   * would hide differences of our forward pass, whose caches under test hold fp32. */
  cp.type_k = GGML_TYPE_F32;
  cp.type_v = GGML_TYPE_F32;
  struct llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == NULL) return 1;
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  if (decode(ctx, tokens, n, 0) != 0) return 1;
  FILE* out = fopen(argv[3], "wb");
  if (out == NULL) return 1;
  for (int i = 0; i < n; ++i) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out);
  fclose(out);
  printf("greedy=");
  int pos = n;
  for (int s = 0; s < steps; ++s) {
    const float* logits = llama_get_logits_ith(ctx, -1);
    llama_token best = 0;
    for (int v = 1; v < n_vocab; ++v) {
      if (logits[v] > logits[best]) best = v;
    }
    printf("%s%d", s ? "," : "", best);
    if (decode(ctx, &best, 1, pos++) != 0) return 1;
  }
  printf("\n");
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
