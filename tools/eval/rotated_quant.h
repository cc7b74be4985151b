// The rotations and codebooks of the rotated-quantization baselines: a randomized Hadamard
// transform per head (what llama.cpp now applies to K and V before quantizing them, and what
// QuaRot and TurboQuant use as a cheap random rotation), and Lloyd-Max scalar codebooks for the
// standard normal distribution, which is what every coordinate of a randomly rotated unit vector
// times sqrt(d) follows for large d (TurboQuant's MSE quantizer).
#ifndef SUBSPACE_TOOLS_EVAL_ROTATED_QUANT_H_
#define SUBSPACE_TOOLS_EVAL_ROTATED_QUANT_H_

#include <cstdint>
#include <span>
#include <vector>

namespace subspace::eval {

// x <- H x / sqrt(n), H the Sylvester Hadamard matrix: orthonormal and its own inverse.
// n a power of two. x: [n]
void NormalizedHadamard(float* x, int n);

// x -> H D x / sqrt(n) with D = diag(random signs from `seed`), and its inverse D H x / sqrt(n).
class RandomizedHadamard {
 public:
  RandomizedHadamard(int n, uint32_t seed);
  int n() const { return static_cast<int>(signs_.size()); }
  void Rotate(float* x) const;    // x: [n]
  void Unrotate(float* x) const;  // x: [n]

 private:
  std::vector<float> signs_;  // [n] +-1
};

// The 2^bits reconstruction levels of the Lloyd-Max (least mean squared error) quantizer of
// N(0, 1), ascending, computed by Lloyd's iteration on the density (bits 1..8).
std::vector<float> GaussianLloydMax(int bits);

// The index of the level nearest to x. levels: ascending
uint32_t NearestLevel(std::span<const float> levels, float x);

// TurboQuant's MSE quantizer on one head's row: rotate, keep the norm (fp16), code each
// coordinate of sqrt(n) x / |x| with a Gaussian Lloyd-Max codebook -- the first `n_high`
// coordinates with bits + 1 bits, the rest with `bits` (fractional average widths) -- decode
// and rotate back (widths up to 5 bits). x: [n]
void RoundTripTurbo(const RandomizedHadamard& rotation, int bits, int n_high, float* x);

}  // namespace subspace::eval

#endif  // SUBSPACE_TOOLS_EVAL_ROTATED_QUANT_H_
