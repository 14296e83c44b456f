// The eigenvalue routines behind `emflow convert --report` on matrices of known spectrum.
#include "tools/spectrum.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <vector>

#include "common/testing.hpp"

namespace {

using emflow::tools::eigenvalues;
using emflow::tools::symmetric_eigenvalues;

// A random orthogonal n x n matrix (row-major): Gram-Schmidt on seeded random columns.
std::vector<double> orthogonal(std::int64_t n, std::uint64_t seed) {
  std::vector<double> q = emflow::testing::uniform(static_cast<std::size_t>(n * n), seed);
  for (std::int64_t c = 0; c < n; ++c) {
    for (int pass = 0; pass < 2; ++pass) {
      for (std::int64_t p = 0; p < c; ++p) {
        double dot = 0;
        for (std::int64_t r = 0; r < n; ++r) dot += q[r * n + c] * q[r * n + p];
        for (std::int64_t r = 0; r < n; ++r) q[r * n + c] -= dot * q[r * n + p];
      }
    }
    double norm = 0;
    for (std::int64_t r = 0; r < n; ++r) norm += q[r * n + c] * q[r * n + c];
    for (std::int64_t r = 0; r < n; ++r) q[r * n + c] /= std::sqrt(norm);
  }
  return q;
}

// Q B Q^T.
std::vector<double> conjugate(const std::vector<double>& q, const std::vector<double>& b,
                              std::int64_t n) {
  std::vector<double> qb(b.size(), 0.0), out(b.size(), 0.0);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t k = 0; k < n; ++k)
      for (std::int64_t j = 0; j < n; ++j) qb[i * n + j] += q[i * n + k] * b[k * n + j];
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t k = 0; k < n; ++k)
      for (std::int64_t j = 0; j < n; ++j) out[i * n + j] += qb[i * n + k] * q[j * n + k];
  return out;
}

TEST(Spectrum, SmallKnownMatrices) {
  const auto sym = symmetric_eigenvalues({2, 1, 1, 2}, 2);
  EXPECT_NEAR(sym[0], 1.0, 1e-14);
  EXPECT_NEAR(sym[1], 3.0, 1e-14);
  const auto rotation = eigenvalues({0, -1, 1, 0}, 2);
  EXPECT_NEAR(rotation[0].real(), 0.0, 1e-14);
  EXPECT_NEAR(rotation[0].imag(), 1.0, 1e-14);
  EXPECT_NEAR(rotation[1].imag(), -1.0, 1e-14);
  // Upper triangular: the diagonal, sorted by descending real part.
  const auto triangular = eigenvalues({1, 5, 7, 0, -2, 3, 0, 0, 4}, 3);
  EXPECT_NEAR(triangular[0].real(), 4.0, 1e-13);
  EXPECT_NEAR(triangular[1].real(), 1.0, 1e-13);
  EXPECT_NEAR(triangular[2].real(), -2.0, 1e-13);
  const auto part = emflow::tools::symmetric_part(std::vector<double>{1, 4, 0, 3}.data(), 2);
  EXPECT_EQ(part, (std::vector<double>{1, 2, 2, 3}));
}

TEST(Spectrum, ConjugatedSpectraOfModelSize) {
  const std::int64_t n = 96;
  const std::vector<double> q = orthogonal(n, 11);
  // Symmetric: Q diag(lambda) Q^T with lambda_k = k - 40.
  std::vector<double> diagonal(static_cast<std::size_t>(n * n), 0.0);
  for (std::int64_t k = 0; k < n; ++k) diagonal[k * n + k] = static_cast<double>(k) - 40.0;
  const auto sym = symmetric_eigenvalues(conjugate(q, diagonal, n), n);
  for (std::int64_t k = 0; k < n; ++k) EXPECT_NEAR(sym[k], k - 40.0, 1e-11) << k;
  // General: 2 x 2 blocks [[a, -b], [b, a]] have eigenvalues a +- ib.
  std::vector<double> blocks(static_cast<std::size_t>(n * n), 0.0);
  std::vector<std::complex<double>> expected;
  for (std::int64_t k = 0; k < n; k += 2) {
    const double a = 0.05 * static_cast<double>(k) - 1.0, b = 0.5 + 0.01 * static_cast<double>(k);
    blocks[k * n + k] = blocks[(k + 1) * n + k + 1] = a;
    blocks[k * n + k + 1] = -b;
    blocks[(k + 1) * n + k] = b;
    expected.emplace_back(a, b);
    expected.emplace_back(a, -b);
  }
  std::sort(expected.begin(), expected.end(), [](const auto& x, const auto& y) {
    return x.real() != y.real() ? x.real() > y.real() : x.imag() > y.imag();
  });
  const auto eig = eigenvalues(conjugate(q, blocks, n), n);
  ASSERT_EQ(eig.size(), expected.size());
  for (std::size_t k = 0; k < eig.size(); ++k) {
    EXPECT_NEAR(eig[k].real(), expected[k].real(), 1e-10) << k;
    EXPECT_NEAR(eig[k].imag(), expected[k].imag(), 1e-10) << k;
  }
}

}  // namespace
