// TransformCodeKernel and TransformExpandKernel: one CTA per (block, KV head), keys then values.
// Rows are handled a rotary pair at a time (the two dims one rotation mixes), so a thread can
// rotate a key back (coding) or to its position (decoding) in registers.
//
// Coding: the head's B rows are read from the page, widened, rotated back (keys before RoPE),
// centred and weighted into shared memory; each (token, component) projection is a float dot
// product with the component's basis row, quantized as ComponentQuantizer::Encode does (round
// half away from zero, clamped); then each thread packs one component's codes, byte by byte.
// Decoding: the codes are widened to coefficients offset + code * step in shared memory, and
// each (token, pair) sums ext + sum_a c_a u_a, unweights, rotates and rounds once to fp16.
#include "kernels/cuda_util.cuh"
#include "kernels/transform_blocks.h"
#include "kernels/transform_rows.cuh"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;

// Shared memory: rows [B, d] float, then codes [active, B] bytes.
int64_t CodeSharedBytes(const KvPoolLayout& l) {
  return static_cast<int64_t>(l.block_size) * l.head_dim * 4 +
         static_cast<int64_t>(l.block_size) * l.head_dim;
}

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    TransformCodeKernel(const __grid_constant__ TransformCodeParams p) {
  const KvPoolLayout& l = p.layout;
  const int blk = blockIdx.x, h = blockIdx.y;
  const int bs = l.block_size;
  constexpr int d = kHeadDim;
  extern __shared__ __align__(16) uint8_t smem[];
  auto* rows = reinterpret_cast<float*>(smem);               // [B, d]
  uint8_t* codes = smem + static_cast<int64_t>(bs) * d * 4;  // [active, B]
  const int32_t src = p.src_page[blk];
  uint8_t* slot = p.dst_pool + l.Slot(p.dst_page[blk], p.dst_slot[blk]);
  const int64_t first = p.first_pos[blk];

  for (int side = 0; side < 2; ++side) {
    const int64_t rec = static_cast<int64_t>(side) * l.n_kv_heads + h;
    const float* f = p.tables.floats + rec * TransformFloats(d);
    const int32_t* n = p.tables.ints + rec * TransformInts(d);
    const int active = n[TransformField::kActive];
    const auto* in = reinterpret_cast<const __half*>(
        p.src_pool + (side == 0 ? l.FullK(src, h) : l.FullV(src, h)));  // [B, d]
    const bool unrotate = side == 0 && p.key_rope.cos_sin != nullptr;
    for (int idx = threadIdx.x; idx < bs * (d / 2); idx += kThreads) {
      const int t = idx / (d / 2), pair = idx % (d / 2);
      int i0, i1;
      bool rotated;
      device::TransformPairDims(pair, p.key_rope, &i0, &i1, &rotated);
      float x0 = __half2float(in[t * d + i0]), x1 = __half2float(in[t * d + i1]);
      if (unrotate && rotated) {
        const float* cs = p.key_rope.cos_sin + ((first + t) * (p.key_rope.rope_dim / 2) + pair) * 2;
        const float c = cs[0], s = cs[1];
        const float y0 = (c * x0 + s * x1) * p.key_rope.unscale;
        const float y1 = (c * x1 - s * x0) * p.key_rope.unscale;
        x0 = y0;
        x1 = y1;
      }
      rows[t * d + i0] =
          (x0 - f[TransformField::kMean * d + i0]) * f[TransformField::kScale * d + i0];
      rows[t * d + i1] =
          (x1 - f[TransformField::kMean * d + i1]) * f[TransformField::kScale * d + i1];
    }
    __syncthreads();
    // Codes: c = u_a . x, quantized.
    for (int idx = threadIdx.x; idx < bs * active; idx += kThreads) {
      const int a = idx / bs, t = idx % bs;
      const float* u = f + TransformField::kBasis * d + static_cast<int64_t>(a) * d;
      const float* x = rows + t * d;
      float c = 0.0f;
      for (int i = 0; i < d; ++i) c = fmaf(__ldg(u + i), x[i], c);
      const int bits = n[TransformField::kBits + a];
      const float offset = f[TransformField::kOffset * d + a],
                  step = f[TransformField::kStep * d + a];
      uint32_t code = 0;
      if (step > 0.0f) {
        const float levels = static_cast<float>((1u << bits) - 1);
        const float q = roundf((c - offset) / step);
        if (q > 0.0f) code = static_cast<uint32_t>(fminf(q, levels));
      }
      codes[a * bs + t] = static_cast<uint8_t>(code);
    }
    __syncthreads();
    // Packing: one component per thread, each byte assembled from the codes that overlap it.
    uint8_t* run = slot + n[TransformField::kRunOffset];
    for (int a = threadIdx.x; a < active; a += kThreads) {
      const int bits = n[TransformField::kBits + a];
      uint8_t* out = run + n[TransformField::kBits + d + a];
      const int nbytes = (bs * bits + 7) / 8;
      for (int k = 0; k < nbytes; ++k) {
        uint32_t byte = 0;
        const int t_end_all = (8 * k + 8 + bits - 1) / bits;
        const int t_end = t_end_all < bs ? t_end_all : bs;
        for (int t = (8 * k) / bits; t < t_end; ++t) {
          const int at = t * bits - 8 * k;  // the code's first bit relative to the byte
          const uint32_t c = codes[a * bs + t];
          byte |= at >= 0 ? c << at : c >> -at;
        }
        out[k] = static_cast<uint8_t>(byte & 0xffu);
      }
    }
    __syncthreads();  // rows and codes are reused by the value side
  }
}

// Shared memory: coefficients [B, active <= d] float.
int64_t ExpandSharedBytes(const KvPoolLayout& l) {
  return static_cast<int64_t>(l.block_size) * l.head_dim * 4;
}

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    TransformExpandKernel(const __grid_constant__ TransformExpandParams p) {
  const KvPoolLayout& l = p.layout;
  const int blk = blockIdx.x, h = blockIdx.y;
  const int bs = l.block_size;
  constexpr int d = kHeadDim;
  extern __shared__ __align__(16) uint8_t smem[];
  auto* coef = reinterpret_cast<float*>(smem);  // [B, active]
  const uint8_t* slot = p.src_pool + l.Slot(p.src_page[blk], p.src_slot[blk]);
  const int32_t dst = p.dst_page[blk];
  const int64_t first = p.first_pos[blk];

  for (int side = 0; side < 2; ++side) {
    const int64_t rec = static_cast<int64_t>(side) * l.n_kv_heads + h;
    const int32_t* n = p.tables.ints + rec * TransformInts(d);
    auto* out = reinterpret_cast<__half*>(
        p.dst_pool + (side == 0 ? l.FullK(dst, h) : l.FullV(dst, h)));  // [B, d]
    device::DecodeTransformRun<kHeadDim, kThreads>(
        p.tables.floats + rec * TransformFloats(d), n, slot + n[TransformField::kRunOffset], bs,
        side == 0 && p.key_rope.cos_sin != nullptr, p.key_rope, first, coef, out);
  }
}

bool RopeOk(const TransformKeyRope& r, int head_dim) {
  if (r.cos_sin == nullptr) return true;
  return r.rope_dim >= 2 && r.rope_dim % 2 == 0 && r.rope_dim <= head_dim && r.max_position > 0;
}

}  // namespace

cudaError_t LaunchTransformCode(const TransformCodeParams& p, cudaStream_t stream) {
  if (TransformLayoutError(p.layout) != nullptr || p.n_blocks < 0 ||
      !RopeOk(p.key_rope, p.layout.head_dim)) {
    return cudaErrorInvalidValue;
  }
  if (p.n_blocks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.n_blocks), static_cast<unsigned>(p.layout.n_kv_heads));
  const size_t smem = static_cast<size_t>(CodeSharedBytes(p.layout));
  SUBSPACE_DISPATCH_HEAD_DIM(p.layout.head_dim, kHeadDim, {
    TransformCodeKernel<kHeadDim><<<grid, kThreads, smem, stream>>>(p);
  })
  return cudaGetLastError();
}

cudaError_t LaunchTransformExpand(const TransformExpandParams& p, cudaStream_t stream) {
  if (TransformLayoutError(p.layout) != nullptr || p.n_blocks < 0 ||
      !RopeOk(p.key_rope, p.layout.head_dim)) {
    return cudaErrorInvalidValue;
  }
  if (p.n_blocks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.n_blocks), static_cast<unsigned>(p.layout.n_kv_heads));
  const size_t smem = static_cast<size_t>(ExpandSharedBytes(p.layout));
  SUBSPACE_DISPATCH_HEAD_DIM(p.layout.head_dim, kHeadDim, {
    TransformExpandKernel<kHeadDim><<<grid, kThreads, smem, stream>>>(p);
  })
  return cudaGetLastError();
}

}  // namespace subspace::kernels
