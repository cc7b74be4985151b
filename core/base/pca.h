// Symmetric eigendecomposition of the d x d Gram matrices that epoch-0 PCA bases come from:
// LAPACK's dsyevd (OpenBLAS), and a cyclic Jacobi solver kept as the dependency-free reference
// the tests compare against.
#ifndef SUBSPACE_CORE_BASE_PCA_H_
#define SUBSPACE_CORE_BASE_PCA_H_

#include <cstdint>
#include <vector>

namespace subspace {

enum class EigenSolver {
  kLapack,  // dsyevd: blocked tridiagonalisation + divide and conquer (faster than dsyevr's
            // partial range at d <= 256, see pca.cc)
  kJacobi,  // cyclic Jacobi over the whole matrix (~6-10 sweeps of O(n^3)); the reference
};

// Eigenvalues of the symmetric n x n matrix `a` (row-major, [n, n]) in descending order,
// with their unit eigenvectors as the COLUMNS of `vecs` ([n, n], row-major). `a` is consumed.
// Jacobi.
void SymmetricEigen(int n, std::vector<double>& a, std::vector<double>* values,
                    std::vector<double>* vecs);

// The top-r eigenpairs of the symmetric matrix `gram` ([n, n]), eigenvalues descending.
// Each eigenvector's sign is fixed so that its largest-magnitude component is positive, which
// makes the result independent of the solver. values: [r]; vecs: [n, r] row-major (columns
// orthonormal). kLapack falls back to Jacobi if LAPACK reports an error.
void TopEigenpairs(int n, const double* gram, int r, EigenSolver solver, double* values,
                   double* vecs);

// The top-r eigenvectors of `gram` ([n, n]) as an n x r row-major float matrix (columns
// orthonormal, signs as TopEigenpairs). out: [n, r]
void TopEigenvectors(int n, const std::vector<double>& gram, int r, float* out,
                     EigenSolver solver = EigenSolver::kLapack);

// A full symmetric copy of the upper triangle (row <= col) of a d x d matrix, the form dsyrk
// accumulates Gram matrices in. upper, result: [d, d]
std::vector<double> SymmetricFromUpper(int d, const double* upper);

// gram = x^T x in double, both triangles (BLAS dsyrk). x: [rows, d]; gram: [d, d]
void GramOfRows(const double* x, int64_t rows, int d, double* gram);

// Switches OpenBLAS's own thread pool off (once per process), so callers may run BLAS/LAPACK
// from several OpenMP threads at once; the same policy as cpu::MatMul (see core/cpu/ops.h).
void UseSingleThreadedBlas();

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_PCA_H_
