// Plain loops over host memory: the references the per-layer kernels are tested against.
#include "tests/kernels/layer_ops_ref.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"

namespace subspace::kernels {

void EmbeddingRef(const EmbeddingParams& p) {
  for (int64_t i = 0; i < p.n; ++i) {
    const int32_t token = p.tokens[i];
    float* out = p.out + i * p.dim;
    for (int64_t j = 0; j < p.dim; ++j) {
      out[j] = token >= 0 && token < p.n_vocab
                   ? HalfToFloat(p.table[static_cast<int64_t>(token) * p.dim + j])
                   : 0.0f;
    }
  }
}

void RmsNormRef(const RmsNormParams& p) {
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t row = p.rows != nullptr ? p.rows[i] : i;
    float* x = p.x + row * p.dim;
    if (p.add != nullptr) {
      for (int64_t j = 0; j < p.dim; ++j) x[j] += p.add[row * p.dim + j];
    }
    double ss = 0.0;
    for (int64_t j = 0; j < p.dim; ++j) ss += static_cast<double>(x[j]) * x[j];
    const auto scale = static_cast<float>(1.0 / std::sqrt(ss / p.dim + p.eps));
    for (int64_t j = 0; j < p.dim; ++j) {
      p.out[i * p.dim + j] = Fp32ToFp16(x[j] * scale * p.weight[j]);
    }
  }
}

void RopeSplitQkvRef(const RopeSplitQkvParams& p) {
  const int64_t hd = p.head_dim, pairs = p.rope_dim / 2;
  const int64_t n_q = p.n_heads * hd, n_kv = p.n_kv_heads * hd;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < p.n; ++i) {
    const float* src = p.qkv + i * (n_q + 2 * n_kv);
    const int32_t pos = p.positions[i];
    const bool pos_ok = pos >= 0 && pos < p.max_position;
    // The row with its biases added (cpu::AddBias's rounding).
    std::vector<float> row(src, src + n_q + 2 * n_kv);
    if (p.bias != nullptr) {
      for (size_t j = 0; j < row.size(); ++j) row[j] += p.bias[j];
    }
    if (p.q_norm != nullptr) {
      // Per-head RMSNorm of Q and K (cpu::RmsNorm's expressions, the sum in double).
      for (int64_t h = 0; h < p.n_heads + p.n_kv_heads; ++h) {
        float* x = row.data() + h * hd;
        const float* w = h < p.n_heads ? p.q_norm : p.k_norm;
        double ss = 0.0;
        for (int64_t d = 0; d < hd; ++d) ss += static_cast<double>(x[d]) * x[d];
        const auto scale = static_cast<float>(1.0 / std::sqrt(ss / hd + p.norm_eps));
        for (int64_t d = 0; d < hd; ++d) x[d] = x[d] * scale * w[d];
      }
    }
    for (int64_t h = 0; h < p.n_heads + p.n_kv_heads; ++h) {
      const float* in = row.data() + h * hd;
      float* out = h < p.n_heads ? p.q + i * n_q + h * hd : p.k + i * n_kv + (h - p.n_heads) * hd;
      for (int64_t d = 0; d < hd; ++d) out[d] = pos_ok ? in[d] : nan;
      if (!pos_ok) continue;
      const float* cs = p.cos_sin + static_cast<int64_t>(pos) * pairs * 2;
      for (int64_t q = 0; q < pairs; ++q) {
        // cpu::Rope's expressions exactly; the host build has no FMA contraction.
        const int64_t a = p.halves ? q : 2 * q;
        const int64_t b = p.halves ? q + pairs : 2 * q + 1;
        const float c = cs[2 * q], s = cs[2 * q + 1];
        const float x0 = in[a], x1 = in[b];
        out[a] = x0 * c - x1 * s;
        out[b] = x0 * s + x1 * c;
      }
    }
    std::memcpy(p.v + i * n_kv, row.data() + n_q + n_kv, static_cast<size_t>(n_kv) * sizeof(float));
  }
}

void SwiGluRef(const SwiGluParams& p) {
  const int64_t ffn = p.ffn;
  for (int64_t i = 0; i < p.n; ++i) {
    const float* gate = p.gate_up + i * 2 * ffn;
    const float* up = gate + ffn;
    for (int64_t j = 0; j < ffn; ++j) {
      p.out[i * ffn + j] = Fp32ToFp16(gate[j] / (1.0f + std::exp(-gate[j])) * up[j]);
    }
  }
}

void ResidualAddRef(const ResidualAddParams& p) {
  for (int64_t i = 0; i < p.n; ++i) p.x[i] += p.y[i];
}

void CastToHalfRef(const CastToHalfParams& p) {
  for (int64_t i = 0; i < p.n; ++i) p.out[i] = Fp32ToFp16(p.in[i]);
}

void GatherRowsToHalfRef(const GatherRowsToHalfParams& p) {
  for (int32_t i = 0; i < p.n_rows; ++i) {
    const float* in = p.in + static_cast<int64_t>(p.rows[i]) * p.width;
    uint16_t* out = p.out + static_cast<int64_t>(i) * p.width;
    for (int32_t j = 0; j < p.width; ++j) out[j] = Fp32ToFp16(in[j]);
  }
}

void AppendKvRef(const AppendKvParams& p) {
  const KvPoolLayout& l = p.layout;
  const int64_t hd = l.head_dim, row = static_cast<int64_t>(l.n_kv_heads) * hd;
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t slot = p.slot_mapping[i];
    if (slot < 0) continue;
    const auto page = static_cast<int32_t>(slot / l.block_size);
    const int64_t t = slot % l.block_size;
    for (int h = 0; h < l.n_kv_heads; ++h) {
      for (int64_t d = 0; d < hd; ++d) {
        const uint16_t k = Fp32ToFp16(p.k[i * row + h * hd + d]);
        const uint16_t v = Fp32ToFp16(p.v[i * row + h * hd + d]);
        std::memcpy(p.pool + l.FullK(page, h) + (t * hd + d) * 2, &k, sizeof(k));
        std::memcpy(p.pool + l.FullV(page, h) + (t * hd + d) * 2, &v, sizeof(v));
      }
    }
  }
}

}  // namespace subspace::kernels
