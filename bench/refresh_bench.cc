// Cost of online basis refresh per method, on the refresher thread: folding one compressed
// block (B = 16 tokens, every layer and KV head) into a session's statistics, and computing a
// new epoch from them, for the default model's geometry (6 layers x 2 KV heads x d 64, r 16) and
// a Llama-8B-like one (32 x 8 x 128, r 32). Random keys and values; prints median times.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "cli/flags.h"
#include "core/base/pca.h"
#include "core/compress/basis.h"
#include "core/compress/online_statistics.h"

ABSL_FLAG(int, iters, 5, "timed repetitions per point (median)");

namespace subspace {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Geometry {
  const char* name;
  KvCacheGeometry g;
  int n_heads;
  int rank;
};

void Run(const Geometry& geo, RefreshMethod method, int iters) {
  const KvCacheGeometry& g = geo.g;
  const std::vector<int> ranks(static_cast<size_t>(g.n_layers), geo.rank);
  Basis initial = Basis::Zeros(g, ranks, ranks);
  for (LayerBasis& lb : initial.layers) {  // any orthonormal start: the first r unit vectors
    for (int h = 0; h < g.n_kv_heads; ++h) {
      for (int j = 0; j < geo.rank; ++j) {
        const size_t at = (static_cast<size_t>(h) * g.head_dim + j) * geo.rank + j;
        lb.p_k[at] = lb.p_q[at] = lb.p_v[at] = 1.0f;
      }
    }
    lb.r_v.assign(lb.r_v.size(), 0.0f);
  }
  initial.MakeOrthogonalFromPkPv();
  RefreshConfig c;
  c.method = method;
  OnlineStatistics stats(g, geo.n_heads, ranks, ranks, c, initial);
  constexpr int kBlock = 16;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(g.n_kv_heads) * kBlock * g.head_dim);
  std::vector<float> v(k.size());
  std::vector<float> q(static_cast<size_t>(kBlock) * geo.n_heads * g.head_dim);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (float& x : q) x = nd(rng);
  std::vector<double> observe, refresh;
  for (int it = 0; it < iters; ++it) {
    const auto t0 = Clock::now();
    for (int blk = 0; blk < 16; ++blk) {  // 256 tokens, a default refresh period
      for (int l = 0; l < g.n_layers; ++l) {
        stats.ObserveBlock(l, k.data(), v.data(), kBlock);
        stats.ObserveQueries(l, q.data(), kBlock);
      }
    }
    const auto t1 = Clock::now();
    absl::StatusOr<Basis> b = stats.Refresh();
    const auto t2 = Clock::now();
    if (!b.ok()) std::fprintf(stderr, "refresh failed: %s\n", b.status().ToString().c_str());
    observe.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / 16);
    refresh.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  std::printf("| %s | %s | %.3f | %.2f |\n", geo.name, RefreshMethodName(method), Median(observe),
              Median(refresh));
}

}  // namespace
}  // namespace subspace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(argc, argv, "subspace-bench-refresh [flags]");
  subspace::UseSingleThreadedBlas();  // the refresher is one thread
  const int iters = absl::GetFlag(FLAGS_iters);
  const subspace::Geometry geos[] = {
      {"default 6x2x64 r16", {.n_layers = 6, .n_kv_heads = 2, .head_dim = 64}, 4, 16},
      {"8B-like 32x8x128 r32", {.n_layers = 32, .n_kv_heads = 8, .head_dim = 128}, 32, 32},
  };
  std::printf("| geometry | method | observe one block, all layers (ms) | refresh (ms) |\n");
  std::printf("|---|---|---|---|\n");
  for (const subspace::Geometry& geo : geos) {
    for (subspace::RefreshMethod m :
         {subspace::RefreshMethod::kPca, subspace::RefreshMethod::kKqsvd,
          subspace::RefreshMethod::kOja, subspace::RefreshMethod::kFd}) {
      subspace::Run(geo, m, iters);
    }
  }
  return 0;
}
