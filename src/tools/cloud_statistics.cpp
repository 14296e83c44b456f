#include "tools/cloud_statistics.hpp"

#include <algorithm>
#include <cmath>

#include "emflow/error.hpp"
#include "tools/spectrum.hpp"

namespace emflow::tools {
namespace {

std::vector<double> unit_rows(const double* cloud, std::int64_t tokens, std::int64_t dim) {
  std::vector<double> u(cloud, cloud + tokens * dim);
  for (std::int64_t i = 0; i < tokens; ++i) {
    double* x = u.data() + i * dim;
    double norm = 0;
    for (std::int64_t a = 0; a < dim; ++a) norm += x[a] * x[a];
    if (norm > 0) {
      norm = std::sqrt(norm);
      for (std::int64_t a = 0; a < dim; ++a) x[a] /= norm;
    }
  }
  return u;
}

}  // namespace

std::vector<std::int64_t> cosine_histogram(const double* cloud, std::int64_t tokens,
                                           std::int64_t dim, std::int64_t bins) {
  if (tokens < 0 || dim < 1 || bins < 1) {
    throw Error(ErrorCode::internal, "cosine_histogram: empty cloud or no bins");
  }
  const std::vector<double> u = unit_rows(cloud, tokens, dim);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(bins), 0);
  for (std::int64_t i = 0; i < tokens; ++i) {
    for (std::int64_t j = i + 1; j < tokens; ++j) {
      double c = 0;
      for (std::int64_t a = 0; a < dim; ++a) c += u[i * dim + a] * u[j * dim + a];
      const double position = std::floor((c + 1.0) / 2.0 * static_cast<double>(bins));
      const auto k =
          static_cast<std::int64_t>(std::clamp(position, 0.0, static_cast<double>(bins - 1)));
      ++counts[static_cast<std::size_t>(k)];
    }
  }
  return counts;
}

double effective_rank(const double* cloud, std::int64_t tokens, std::int64_t dim) {
  if (tokens < 1 || dim < 1) throw Error(ErrorCode::internal, "effective_rank: empty cloud");
  const std::vector<double> u = unit_rows(cloud, tokens, dim);
  // The squared singular values are the eigenvalues of the smaller Gram matrix.
  const std::int64_t n = std::min(tokens, dim);
  std::vector<double> gram(static_cast<std::size_t>(n * n), 0.0);
  for (std::int64_t p = 0; p < n; ++p) {
    for (std::int64_t q = p; q < n; ++q) {
      double s = 0;
      if (tokens <= dim) {
        for (std::int64_t a = 0; a < dim; ++a) s += u[p * dim + a] * u[q * dim + a];
      } else {
        for (std::int64_t i = 0; i < tokens; ++i) s += u[i * dim + p] * u[i * dim + q];
      }
      gram[static_cast<std::size_t>(p * n + q)] = gram[static_cast<std::size_t>(q * n + p)] = s;
    }
  }
  std::vector<double> sigma = symmetric_eigenvalues(gram, n);
  double total = 0;
  for (double& s : sigma) {
    s = std::sqrt(std::max(s, 0.0));
    total += s;
  }
  if (total <= 0) return 0.0;  // every token is zero
  double entropy = 0;
  for (double s : sigma) {
    const double p = s / total;
    if (p > 0) entropy -= p * std::log(p);
  }
  return std::exp(entropy);
}

}  // namespace emflow::tools
