// Symmetric eigendecomposition by cyclic Jacobi rotations (double precision): small, exact
// enough and dependency-free for the d <= 256 Gram matrices of one KV head.
#ifndef SUBSPACE_CORE_PCA_H_
#define SUBSPACE_CORE_PCA_H_

#include <vector>

namespace subspace {

// Eigenvalues of the symmetric n x n matrix `a` (row-major, [n, n]) in descending order,
// with their unit eigenvectors as the COLUMNS of `vecs` ([n, n], row-major). `a` is consumed.
void SymmetricEigen(int n, std::vector<double>& a, std::vector<double>* values,
                    std::vector<double>* vecs);

// The top-r eigenvectors of the symmetric matrix `gram` ([n, n]) as an n x r row-major float
// matrix (columns orthonormal). out: [n, r]
void TopEigenvectors(int n, const std::vector<double>& gram, int r, float* out);

}  // namespace subspace

#endif  // SUBSPACE_CORE_PCA_H_
