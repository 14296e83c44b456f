#include "pca.hpp"

#include <algorithm>
#include <cmath>

namespace emflow::tools {
namespace {

// Top two principal directions of `points` (count x d, centred by the caller) by power
// iteration with deflation: d is at most a few hundred, so the d x d covariance is small.
std::vector<double> principal_plane(const std::vector<double>& points, std::int64_t count,
                                    std::int64_t d) {
  std::vector<double> cov(static_cast<std::size_t>(d * d), 0.0);
  for (std::int64_t p = 0; p < count; ++p) {
    const double* x = points.data() + p * d;
    for (std::int64_t a = 0; a < d; ++a)
      for (std::int64_t b = 0; b < d; ++b) cov[static_cast<std::size_t>(a * d + b)] += x[a] * x[b];
  }
  std::vector<double> axes(static_cast<std::size_t>(2 * d), 0.0);
  for (int k = 0; k < 2; ++k) {
    std::vector<double> v(static_cast<std::size_t>(d)), w(v.size());
    for (std::int64_t a = 0; a < d; ++a) v[static_cast<std::size_t>(a)] = 1.0 + 0.01 * a + (a == k);
    for (int iteration = 0; iteration < 300; ++iteration) {
      for (std::int64_t a = 0; a < d; ++a) {
        double s = 0.0;
        for (std::int64_t b = 0; b < d; ++b)
          s += cov[static_cast<std::size_t>(a * d + b)] * v[static_cast<std::size_t>(b)];
        w[static_cast<std::size_t>(a)] = s;
      }
      if (k == 1) {  // stay orthogonal to the first axis
        double dot = 0.0;
        for (std::int64_t a = 0; a < d; ++a)
          dot += w[static_cast<std::size_t>(a)] * axes[static_cast<std::size_t>(a)];
        for (std::int64_t a = 0; a < d; ++a)
          w[static_cast<std::size_t>(a)] -= dot * axes[static_cast<std::size_t>(a)];
      }
      double norm = 0.0;
      for (double x : w) norm += x * x;
      norm = std::sqrt(norm);
      if (norm == 0.0) break;
      for (std::int64_t a = 0; a < d; ++a)
        v[static_cast<std::size_t>(a)] = w[static_cast<std::size_t>(a)] / norm;
    }
    std::copy(v.begin(), v.end(), axes.begin() + k * d);
  }
  return axes;
}

}  // namespace

void principal_projection(const std::vector<double>& points, std::int64_t count, std::int64_t d,
                          std::vector<double>& u, std::vector<double>& v) {
  std::vector<double> centred = points;
  std::vector<double> mean(static_cast<std::size_t>(d), 0.0);
  for (std::int64_t e = 0; e < count; ++e)
    for (std::int64_t a = 0; a < d; ++a)
      mean[static_cast<std::size_t>(a)] += centred[static_cast<std::size_t>(e * d + a)];
  for (double& m : mean) m /= static_cast<double>(count);
  for (std::int64_t e = 0; e < count; ++e)
    for (std::int64_t a = 0; a < d; ++a)
      centred[static_cast<std::size_t>(e * d + a)] -= mean[static_cast<std::size_t>(a)];
  const std::vector<double> axes = principal_plane(centred, count, d);
  for (std::int64_t e = 0; e < count; ++e) {
    double s = 0.0, t = 0.0;
    for (std::int64_t a = 0; a < d; ++a) {
      s += centred[static_cast<std::size_t>(e * d + a)] * axes[static_cast<std::size_t>(a)];
      t += centred[static_cast<std::size_t>(e * d + a)] * axes[static_cast<std::size_t>(d + a)];
    }
    u[static_cast<std::size_t>(e)] = s;
    v[static_cast<std::size_t>(e)] = t;
  }
}

}  // namespace emflow::tools
