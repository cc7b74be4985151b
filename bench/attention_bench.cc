// Decode attention time vs context and batch: full-rank paged cache against the compressed
// cache (fp16, int8 coefficients, r = d/4, S = 4, W = 64, B = 16), one layer, random K/V and
// an installed orthonormal basis; the quantized paged cache (q8_0, q4_0); and the transform-coded
// cache (codes at 2.5 / 1.5 bits fitted on rows drawn like the K/V, keys coded before RoPE and
// after it; bytes alike). Prints time
// per step and, beside the time ratio, the ratio of bytes the cache holds. With --epoch_table,
// first the cost of building a PCA epoch 0 (Gram matrices + eigendecomposition) and of the Commit
// that triggers it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "cli/flags.h"
#include "core/base/pca.h"
#include "core/compress/compressed_kv_cache.h"
#include "core/compress/transform_kv_cache.h"
#include "core/kvcache/paged_kv_cache.h"

ABSL_FLAG(std::string, contexts, "1024,4096,16384", "context lengths");
ABSL_FLAG(std::string, batches, "1,8", "batch sizes");
ABSL_FLAG(int, iters, 5, "timed decode steps per point (median)");
ABSL_FLAG(bool, small_geometry, true, "also run the default model's 4/2/64 geometry");
ABSL_FLAG(bool, epoch_table, true, "time building a PCA epoch 0 (6x2x64 and 32x8x128)");
ABSL_FLAG(bool, attention_table, true, "time decode attention");

namespace subspace {
namespace {

std::vector<int> ParseList(const std::string& s) {
  std::vector<int> out;
  size_t p = 0;
  while (p < s.size()) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    out.push_back(std::stoi(s.substr(p, q - p)));
    p = q + 1;
  }
  return out;
}

struct Geo {
  int n_heads, n_kv, hd;
};

std::shared_ptr<Basis> RandomBasis(const KvCacheGeometry& g, int r, std::mt19937& rng) {
  auto b = std::make_shared<Basis>(Basis::Zeros(g, {r}, {r}));
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (LayerBasis& lb : b->layers) {
    for (auto* m : {&lb.p_k, &lb.p_v}) {
      for (int h = 0; h < g.n_kv_heads; ++h) {  // Gram-Schmidt per head: [d, r] columns
        float* a = m->data() + static_cast<size_t>(h) * g.head_dim * r;
        for (int i = 0; i < g.head_dim * r; ++i) a[i] = n(rng);
        for (int j = 0; j < r; ++j) {
          for (int k = 0; k < j; ++k) {
            float dot = 0;
            for (int i = 0; i < g.head_dim; ++i) dot += a[i * r + j] * a[i * r + k];
            for (int i = 0; i < g.head_dim; ++i) a[i * r + j] -= dot * a[i * r + k];
          }
          float nn = 0;
          for (int i = 0; i < g.head_dim; ++i) nn += a[i * r + j] * a[i * r + j];
          for (int i = 0; i < g.head_dim; ++i) a[i * r + j] /= std::sqrt(nn);
        }
      }
    }
  }
  b->MakeOrthogonalFromPkPv();
  return b;
}

// Transform codes at `bits` per element for every KV head of a one-layer geometry, fitted on
// standard normal rows (what Run writes).
std::shared_ptr<const std::vector<TransformCode>> RandomCodes(const KvCacheGeometry& g, double bits,
                                                              std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<TransformStream> streams;
  const int rows = 2048;
  std::vector<float> x(static_cast<size_t>(rows) * g.head_dim);
  for (int h = 0; h < g.n_kv_heads; ++h) {
    for (float& v : x) v = n(rng);
    streams.push_back(*AnalyzeStream(x.data(), rows, g.head_dim, {}));
  }
  const std::vector<int> widths = {0, 2, 3, 4, 8};
  return std::make_shared<const std::vector<TransformCode>>(
      *AllocateTransformCodes(streams, widths, bits, /*joint=*/false));
}

// Fills `batch` sequences to `ctx` tokens, then times decode attention (one query each).
// Returns {median seconds per step, bytes used}.
std::pair<double, int64_t> Run(KvCache& cache, const Geo& geo, int ctx, int batch, int iters,
                               std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  const int64_t row = static_cast<int64_t>(geo.n_kv) * geo.hd;
  const int chunk = 1024;
  std::vector<float> k(static_cast<size_t>(chunk) * row), v(k.size());
  for (float& x : k) x = n(rng);
  for (float& x : v) x = n(rng);
  std::vector<SeqId> seqs;
  for (int b = 0; b < batch; ++b) {
    SeqId s = *cache.CreateSequence();
    seqs.push_back(s);
    for (int p = 0; p < ctx; p += chunk) {
      const int m = std::min(chunk, ctx - p);
      if (!cache.Reserve(s, m).ok()) {
        std::fprintf(stderr, "pool too small\n");
        std::exit(1);
      }
      cache.Write(0, s, p, m, k.data(), v.data());
      (void)cache.Commit(s, p + m);
    }
    (void)cache.Reserve(s, 1);
    cache.Write(0, s, ctx, 1, k.data(), v.data());
  }
  std::vector<float> q(static_cast<size_t>(batch) * geo.n_heads * geo.hd), out(q.size());
  for (float& x : q) x = n(rng);
  std::vector<AttentionRequest> reqs;
  for (int b = 0; b < batch; ++b) {
    reqs.push_back({seqs[b], ctx, 1, q.data() + static_cast<size_t>(b) * geo.n_heads * geo.hd,
                    out.data() + static_cast<size_t>(b) * geo.n_heads * geo.hd});
  }
  cache.Attend(0, reqs, geo.n_heads);  // warm-up
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    cache.Attend(0, reqs, geo.n_heads);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  const KvCacheStats st = cache.Stats();
  const int64_t used = st.bytes_used_full + st.bytes_used_compressed + st.bytes_used_outlier;
  for (SeqId s : seqs) (void)cache.FreeSequence(s);
  return {t[t.size() / 2], used};
}

void Table(const Geo& geo, const std::vector<int>& contexts, const std::vector<int>& batches,
           int iters) {
  std::printf("\nheads %d, kv heads %d, head_dim %d, r_k = r_v = %d, B 16, S 4, W 64 (1 layer)\n",
              geo.n_heads, geo.n_kv, geo.hd, geo.hd / 4);
  std::printf(
      "%7s %5s | %10s | %10s %7s %7s | %10s %7s %7s | %10s %7s %7s | %10s %7s %7s | %10s %7s "
      "%7s | %10s %7s\n",
      "context", "batch", "full ms", "fp16 ms", "t ratio", "B ratio", "int8 ms", "t ratio",
      "B ratio", "q8_0 ms", "t ratio", "B ratio", "q4_0 ms", "t ratio", "B ratio", "tc pre ms",
      "t ratio", "B ratio", "tc post ms", "t ratio");
  const KvCacheGeometry g{1, geo.n_kv, geo.hd};
  std::mt19937 rng(1);
  for (int ctx : contexts) {
    for (int batch : batches) {
      const int64_t pages = static_cast<int64_t>(batch) * (ctx / 16 + 2) + 8;
      PagedKvCache::Config pc{g, 16, pages * PagedKvCache::BlockBytes(g, 16)};
      double full_t;
      int64_t full_b;
      {
        auto paged = *PagedKvCache::Create(pc);
        std::tie(full_t, full_b) = Run(*paged, geo, ctx, batch, iters, rng);
      }
      double ct[2];
      int64_t cb[2];
      for (int i = 0; i < 2; ++i) {
        CompressedKvCacheConfig c;
        c.geometry = g;
        c.block_size = 16;
        c.policy.sink_tokens = 4;
        c.policy.window_tokens = 64;
        c.policy.coeff_dtype = i == 0 ? CoeffDtype::kFp16 : CoeffDtype::kInt8;  // fp16 full blocks
        // Room for one sequence's full prefill chunk (1024) plus everyone compressed.
        c.capacity_bytes = (static_cast<int64_t>(batch) * (ctx / 16 / 3 + 8) + 72) *
                           CompressedKvCache::PageBytes(g, 16, c.full_dtype);
        auto cache = *CompressedKvCache::Create(c);
        const EpochId e = *cache->InstallBasis(RandomBasis(g, geo.hd / 4, rng));
        (void)cache->SetDefaultEpoch(e);
        std::tie(ct[i], cb[i]) = Run(*cache, geo, ctx, batch, iters, rng);
      }
      // The full-rank paged cache with quantized rows (--kv-cache quantized).
      double qt[2];
      int64_t qb[2];
      for (int i = 0; i < 2; ++i) {
        const KvDtype dtype = i == 0 ? KvDtype::kQ8_0 : KvDtype::kQ4_0;
        PagedKvCache::Config qc{g, 16, pages * PagedKvCache::BlockBytes(g, 16, dtype), dtype};
        auto paged = *PagedKvCache::Create(qc);
        std::tie(qt[i], qb[i]) = Run(*paged, geo, ctx, batch, iters, rng);
      }
      // The transform-coded cache (--kv-cache transform) at 2.5 / 1.5 bits, keys coded before
      // RoPE (decoded each step) and after it (scored in code space).
      double tt, tt_post;
      int64_t tb;
      for (const bool pre_rope : {true, false}) {
        TransformKvCacheConfig c{
            .geometry = g,
            .block_size = 16,
            .sink_tokens = 4,
            .window_tokens = 64,
            .key_codes = RandomCodes(g, 2.5, rng),
            .value_codes = RandomCodes(g, 1.5, rng),
            .key_rope = *RopeSchedule::Make({.dim = geo.hd}),
            .capacity_bytes = (static_cast<int64_t>(batch) * (ctx / 16 / 3 + 8) + 72) *
                              TransformKvCache::PageBytes(g, 16)};
        if (!pre_rope) c.key_rope.reset();
        auto cache = *TransformKvCache::Create(c);
        std::tie(pre_rope ? tt : tt_post, tb) = Run(*cache, geo, ctx, batch, iters, rng);
      }
      std::printf(
          "%7d %5d | %10.3f | %10.3f %7.3f %7.3f | %10.3f %7.3f %7.3f | %10.3f %7.3f %7.3f | "
          "%10.3f %7.3f %7.3f | %10.3f %7.3f %7.3f | %10.3f %7.3f\n",
          ctx, batch, full_t * 1e3, ct[0] * 1e3, ct[0] / full_t,
          static_cast<double>(cb[0]) / full_b, ct[1] * 1e3, ct[1] / full_t,
          static_cast<double>(cb[1]) / full_b, qt[0] * 1e3, qt[0] / full_t,
          static_cast<double>(qb[0]) / full_b, qt[1] * 1e3, qt[1] / full_t,
          static_cast<double>(qb[1]) / full_b, tt * 1e3, tt / full_t,
          static_cast<double>(tb) / full_b, tt_post * 1e3, tt_post / full_t);
      std::fflush(stdout);
    }
  }
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Epoch 0 for one model geometry from T tokens of synthetic keys/values (a decaying spectrum,
// like real activations). "before" columns are the pre-LAPACK code path: the scalar Gram loop
// over every token and serial Jacobi; "after" is dsyrk + dsyevd over (layer, head) in parallel.
void EpochTable() {
  UseSingleThreadedBlas();  // as the server runs it (cpu::MatMul switches OpenBLAS threads off)
  std::printf(
      "\nPCA epoch 0, r = d/4, T = 1024 tokens; ms (Jacobi at 32x8x128 timed on 16 "
      "of the matrices and scaled)\n");
  std::printf("%-12s | %11s %11s | %11s %11s %11s | %12s %12s\n", "geometry", "gram loop",
              "gram dsyrk", "Jacobi 1thr", "dsyevd 1thr", "PcaBasis", "Commit 1st", "Commit 2nd");
  for (const KvCacheGeometry g : {KvCacheGeometry{6, 2, 64}, KvCacheGeometry{32, 8, 128}}) {
    const int d = g.head_dim, T = 1024, r = d / 4, n_kv = g.n_kv_heads;
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> scale(static_cast<size_t>(d));
    for (int i = 0; i < d; ++i) scale[i] = std::exp(-0.05f * i);
    // [n_layers][T, n_kv, d], one set reused as K and V
    std::vector<std::vector<float>> kv(static_cast<size_t>(g.n_layers));
    for (auto& x : kv) {
      x.resize(static_cast<size_t>(T) * n_kv * d);
      for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * scale[i % d];
    }
    const size_t dd = static_cast<size_t>(d) * d;
    std::vector<std::vector<double>> grams(static_cast<size_t>(g.n_layers),
                                           std::vector<double>(n_kv * dd, 0.0));
    auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < g.n_layers; ++l) {  // the old EnsureEpoch loop, for K only: x2 below
      for (int h = 0; h < n_kv; ++h) {
        double* gh = grams[l].data() + h * dd;
        for (int t = 0; t < T; ++t) {
          const float* x = kv[l].data() + (static_cast<size_t>(t) * n_kv + h) * d;
          for (int i = 0; i < d; ++i) {
            for (int j = 0; j < d; ++j)
              gh[static_cast<size_t>(i) * d + j] += static_cast<double>(x[i]) * x[j];
          }
        }
      }
    }
    const double gram_loop = 2 * Seconds(t0);
    t0 = std::chrono::steady_clock::now();
    std::vector<double> rows(static_cast<size_t>(T) * d);
    for (int rep = 0; rep < 2; ++rep) {
      for (int l = 0; l < g.n_layers; ++l) {
        for (int h = 0; h < n_kv; ++h) {
          for (int t = 0; t < T; ++t) {
            const float* x = kv[l].data() + (static_cast<size_t>(t) * n_kv + h) * d;
            std::copy(x, x + d, rows.begin() + static_cast<int64_t>(t) * d);
          }
          GramOfRows(rows.data(), T, d, grams[l].data() + h * dd);
        }
      }
    }
    const double gram_blas = Seconds(t0);
    const int mats = 2 * g.n_layers * n_kv;
    const int jacobi_mats = d > 64 ? 16 : mats;
    std::vector<float> out(static_cast<size_t>(d) * r);
    t0 = std::chrono::steady_clock::now();
    for (int m = 0; m < jacobi_mats; ++m) {
      const std::vector<double> gm(
          grams[m / 2 % g.n_layers].begin() + (m / 2 / g.n_layers % n_kv) * dd,
          grams[m / 2 % g.n_layers].begin() + (m / 2 / g.n_layers % n_kv + 1) * dd);
      TopEigenvectors(d, gm, r, out.data(), EigenSolver::kJacobi);
    }
    const double jacobi = Seconds(t0) * mats / jacobi_mats;
    t0 = std::chrono::steady_clock::now();
    for (int m = 0; m < mats; ++m) {
      const std::vector<double> gm(
          grams[m / 2 % g.n_layers].begin() + (m / 2 / g.n_layers % n_kv) * dd,
          grams[m / 2 % g.n_layers].begin() + (m / 2 / g.n_layers % n_kv + 1) * dd);
      TopEigenvectors(d, gm, r, out.data(), EigenSolver::kLapack);
    }
    const double lapack = Seconds(t0);
    const std::vector<int> ranks(static_cast<size_t>(g.n_layers), r);
    (void)PcaBasis(g, ranks, ranks, grams, grams);  // warm-up: starts the OpenMP pool
    t0 = std::chrono::steady_clock::now();
    const Basis basis = PcaBasis(g, ranks, ranks, grams, grams);
    const double pca_basis = Seconds(t0);
    // Through the cache: two sequences prefill T tokens in one chunk; the first Commit builds
    // the epoch (and compresses), the second only compresses.
    CompressedKvCacheConfig c;
    c.geometry = g;
    c.capacity_bytes = static_cast<int64_t>(2 * (T / 16 + 2) * g.n_layers + 8) *
                       CompressedKvCache::PageBytes(g, 16, c.full_dtype);
    auto cache = *CompressedKvCache::Create(c);
    double commit[2];
    for (int i = 0; i < 2; ++i) {
      const SeqId s = *cache->CreateSequence();
      (void)cache->Reserve(s, T);
      for (int l = 0; l < g.n_layers; ++l) cache->Write(l, s, 0, T, kv[l].data(), kv[l].data());
      t0 = std::chrono::steady_clock::now();
      (void)cache->Commit(s, T);
      commit[i] = Seconds(t0);
    }
    std::printf("%2dx%dx%-7d | %11.2f %11.2f | %11.2f %11.2f %11.2f | %12.2f %12.2f\n", g.n_layers,
                n_kv, d, gram_loop * 1e3, gram_blas * 1e3, jacobi * 1e3, lapack * 1e3,
                pca_basis * 1e3, commit[0] * 1e3, commit[1] * 1e3);
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace subspace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(argc, argv, "subspace-bench-attention [flags]");
  const auto contexts = subspace::ParseList(absl::GetFlag(FLAGS_contexts));
  const auto batches = subspace::ParseList(absl::GetFlag(FLAGS_batches));
  const int iters = absl::GetFlag(FLAGS_iters);
  std::printf(
      "decode attention, median of %d steps; B ratio = bytes held (compressed / full "
      "fp32 paged)\n",
      iters);
  if (absl::GetFlag(FLAGS_epoch_table)) subspace::EpochTable();
  if (!absl::GetFlag(FLAGS_attention_table)) return 0;
  subspace::Table({32, 8, 128}, contexts, batches, iters);
  if (absl::GetFlag(FLAGS_small_geometry)) subspace::Table({4, 2, 64}, contexts, batches, iters);
  return 0;
}
