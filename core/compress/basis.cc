// Basis construction helpers and the epoch registry.
#include "core/compress/basis.h"

#include <cassert>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"

namespace subspace {

Basis Basis::Zeros(const KvCacheGeometry& g, const std::vector<int>& r_k,
                   const std::vector<int>& r_v) {
  Basis b;
  b.geometry = g;
  b.layers.resize(static_cast<size_t>(g.n_layers));
  const size_t hd = static_cast<size_t>(g.head_dim), nkv = static_cast<size_t>(g.n_kv_heads);
  for (size_t l = 0; l < b.layers.size(); ++l) {
    LayerBasis& lb = b.layers[l];
    lb.rank_k = r_k[l];
    lb.rank_v = r_v[l];
    lb.p_q.assign(nkv * hd * static_cast<size_t>(lb.rank_k), 0.0f);
    lb.p_k.assign(nkv * hd * static_cast<size_t>(lb.rank_k), 0.0f);
    lb.p_v.assign(nkv * hd * static_cast<size_t>(lb.rank_v), 0.0f);
    lb.r_v.assign(nkv * hd * static_cast<size_t>(lb.rank_v), 0.0f);
  }
  return b;
}

void Basis::MakeOrthogonalFromPkPv() {
  const int d = geometry.head_dim;
  for (LayerBasis& lb : layers) {
    lb.p_q = lb.p_k;
    for (int h = 0; h < geometry.n_kv_heads; ++h) {
      const float* pv = lb.p_v.data() + static_cast<size_t>(h) * d * lb.rank_v;  // [d, r_v]
      float* rv = lb.r_v.data() + static_cast<size_t>(h) * lb.rank_v * d;        // [r_v, d]
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j < lb.rank_v; ++j)
          rv[static_cast<size_t>(j) * d + i] = pv[static_cast<size_t>(i) * lb.rank_v + j];
      }
    }
  }
}

bool SameBasisMatrices(const Basis& a, const Basis& b) {
  if (a.layers.size() != b.layers.size()) return false;
  auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
  };
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerBasis &x = a.layers[l], &y = b.layers[l];
    if (x.rank_k != y.rank_k || x.rank_v != y.rank_v || !same(x.p_q, y.p_q) ||
        !same(x.p_k, y.p_k) || !same(x.p_v, y.p_v) || !same(x.r_v, y.r_v)) {
      return false;
    }
  }
  return true;
}

absl::Status ValidateBasis(const Basis& b, const KvCacheGeometry& g, const std::vector<int>& r_k,
                           const std::vector<int>& r_v) {
  if (b.geometry.n_layers != g.n_layers || b.geometry.n_kv_heads != g.n_kv_heads ||
      b.geometry.head_dim != g.head_dim || b.layers.size() != static_cast<size_t>(g.n_layers)) {
    return absl::InvalidArgumentError("basis geometry does not match the KV cache");
  }
  const size_t hd = static_cast<size_t>(g.head_dim), nkv = static_cast<size_t>(g.n_kv_heads);
  for (size_t l = 0; l < b.layers.size(); ++l) {
    const LayerBasis& lb = b.layers[l];
    if (lb.rank_k != r_k[l] || lb.rank_v != r_v[l]) {
      return absl::InvalidArgumentError(
          absl::StrFormat("basis layer %d has ranks (%d, %d), the cache (%d, %d)", l, lb.rank_k,
                          lb.rank_v, r_k[l], r_v[l]));
    }
    const size_t nk = nkv * hd * static_cast<size_t>(lb.rank_k);
    const size_t nv = nkv * hd * static_cast<size_t>(lb.rank_v);
    if (lb.p_q.size() != nk || lb.p_k.size() != nk || lb.p_v.size() != nv || lb.r_v.size() != nv) {
      return absl::InvalidArgumentError(
          absl::StrFormat("basis layer %d has wrong matrix sizes", l));
    }
  }
  return absl::OkStatus();
}

Basis PcaBasis(const KvCacheGeometry& g, const std::vector<int>& r_k, const std::vector<int>& r_v,
               const std::vector<std::vector<double>>& grams_k,
               const std::vector<std::vector<double>>& grams_v, EigenSolver solver) {
  Basis b = Basis::Zeros(g, r_k, r_v);
  const int d = g.head_dim;
  const size_t dd = static_cast<size_t>(d) * d;
  // One item per (layer, head, K or V); each writes its own slice of the basis.
  const int64_t items = static_cast<int64_t>(g.n_layers) * g.n_kv_heads * 2;
  UseSingleThreadedBlas();
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const size_t l = static_cast<size_t>(item / (2 * g.n_kv_heads));
    const int h = static_cast<int>(item / 2 % g.n_kv_heads);
    const bool keys = item % 2 == 0;
    LayerBasis& lb = b.layers[l];
    const int r = keys ? lb.rank_k : lb.rank_v;
    const double* gram = (keys ? grams_k : grams_v)[l].data() + h * dd;
    float* out = (keys ? lb.p_k : lb.p_v).data() + static_cast<size_t>(h) * d * r;
    std::vector<double> values(static_cast<size_t>(r)), vecs(static_cast<size_t>(d) * r);
    TopEigenpairs(d, gram, r, solver, values.data(), vecs.data());
    for (size_t i = 0; i < vecs.size(); ++i) out[i] = static_cast<float>(vecs[i]);
  }
  b.MakeOrthogonalFromPkPv();
  return b;
}

EpochId BasisRegistry::Register(std::shared_ptr<const Basis> basis) {
  const EpochId id = next_id_++;
  epochs_[id] = Entry{std::move(basis), 1};
  return id;
}

absl::Status BasisRegistry::Acquire(EpochId id) {
  auto it = epochs_.find(id);
  if (it == epochs_.end())
    return absl::NotFoundError(absl::StrFormat("unknown basis epoch %d", id));
  ++it->second.refs;
  return absl::OkStatus();
}

void BasisRegistry::Release(EpochId id) {
  auto it = epochs_.find(id);
  assert(it != epochs_.end() && it->second.refs > 0);
  if (it == epochs_.end()) return;
  if (--it->second.refs == 0) epochs_.erase(it);
}

const Basis* BasisRegistry::Get(EpochId id) const {
  auto it = epochs_.find(id);
  return it == epochs_.end() ? nullptr : it->second.basis.get();
}

std::shared_ptr<const Basis> BasisRegistry::GetShared(EpochId id) const {
  auto it = epochs_.find(id);
  return it == epochs_.end() ? nullptr : it->second.basis;
}

int32_t BasisRegistry::RefCount(EpochId id) const {
  auto it = epochs_.find(id);
  return it == epochs_.end() ? 0 : it->second.refs;
}

}  // namespace subspace
