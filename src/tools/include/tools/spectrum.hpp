// Eigenvalues of small dense matrices through LAPACK (dsyev, dgeev), for the spectra that
// `emflow convert --report` prints: the symmetric part of each relevance operator M_h and each
// content operator F_h.
#pragma once

#include <complex>
#include <cstdint>
#include <vector>

namespace emflow::tools {

/// Eigenvalues of the symmetric n x n matrix `a` (row-major; only its symmetry is assumed),
/// ascending. Throws emflow::Error (ErrorCode::internal) when LAPACK reports a failure.
std::vector<double> symmetric_eigenvalues(const std::vector<double>& a, std::int64_t n);

/// Eigenvalues of the general n x n matrix `a` (row-major), complex conjugate pairs adjacent,
/// sorted by descending real part, then by descending imaginary part.
std::vector<std::complex<double>> eigenvalues(const std::vector<double>& a, std::int64_t n);

/// The symmetric part (A + A^T) / 2 of the n x n matrix `a`.
std::vector<double> symmetric_part(const double* a, std::int64_t n);

}  // namespace emflow::tools
