// Integer helpers every module uses (block counts, pages, grid sizes).
#ifndef SUBSPACE_CORE_BASE_INT_MATH_H_
#define SUBSPACE_CORE_BASE_INT_MATH_H_

#include <cstdint>

namespace subspace {

// ceil(a / b) for a >= 0, b > 0.
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_INT_MATH_H_
