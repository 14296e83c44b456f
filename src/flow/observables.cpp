// What the flow does to a cloud, in numbers (REFERENCE.md §4): pairwise inner products, the
// clustered pairs and their clusters, the interaction energy and the diameter. One pass over
// the pairs in double on the host.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "../core/check.hpp"
#include "emflow/flow.hpp"

namespace emflow::flow {

namespace {

// Union-find with path halving: the clusters are the connected components of the graph whose
// edges are the clustered pairs.
struct Components {
  std::vector<std::int64_t> parent;
  explicit Components(std::int64_t n) : parent(static_cast<std::size_t>(n)) {
    std::iota(parent.begin(), parent.end(), std::int64_t{0});
  }
  std::int64_t find(std::int64_t a) {
    while (parent[static_cast<std::size_t>(a)] != a) {
      auto& p = parent[static_cast<std::size_t>(a)];
      p = parent[static_cast<std::size_t>(p)];
      a = p;
    }
    return a;
  }
  bool join(std::int64_t a, std::int64_t b) {
    a = find(a);
    b = find(b);
    if (a == b) return false;
    parent[static_cast<std::size_t>(std::max(a, b))] = std::min(a, b);
    return true;
  }
};

}  // namespace

template <class T>
Observables observe(const T* cloud, std::int64_t tokens, std::int64_t dim, double beta,
                    double cluster_eps) {
  if (tokens < 2) {
    emflow::detail::fail_argument("observe", "tokens", "must be >= 2, got ", tokens);
  }
  const std::int64_t N = tokens, d = dim;
  std::vector<double> norms(static_cast<std::size_t>(N));
  double energy = 0.0;  // sum_ij exp(beta <x_i, x_j>), the diagonal included
  for (std::int64_t i = 0; i < N; ++i) {
    double square = 0.0;
    for (std::int64_t a = 0; a < d; ++a)
      square += static_cast<double>(cloud[i * d + a]) * cloud[i * d + a];
    norms[static_cast<std::size_t>(i)] = std::sqrt(square);
    energy += std::exp(beta * square);
  }

  Observables o;
  o.min_inner = std::numeric_limits<double>::infinity();
  double sum_inner = 0.0, diameter_sq = 0.0;
  std::int64_t clustered = 0, components = N;
  Components graph(N);
  for (std::int64_t i = 0; i < N; ++i) {
    const T* xi = cloud + i * d;
    for (std::int64_t j = i + 1; j < N; ++j) {
      const T* xj = cloud + j * d;
      double inner = 0.0, distance_sq = 0.0;
      for (std::int64_t a = 0; a < d; ++a) {
        const double u = static_cast<double>(xi[a]), v = static_cast<double>(xj[a]);
        inner += u * v;
        distance_sq += (u - v) * (u - v);
      }
      o.min_inner = std::min(o.min_inner, inner);
      sum_inner += inner;
      diameter_sq = std::max(diameter_sq, distance_sq);
      energy += 2.0 * std::exp(beta * inner);
      // Clustering is about directions: the cosine, which is the inner product on the sphere.
      const double scale = norms[static_cast<std::size_t>(i)] * norms[static_cast<std::size_t>(j)];
      if (scale > 0.0 && inner > (1.0 - cluster_eps) * scale) {
        ++clustered;
        if (graph.join(i, j)) --components;
      }
    }
  }
  const double pairs = 0.5 * static_cast<double>(N) * static_cast<double>(N - 1);
  o.mean_inner = sum_inner / pairs;
  o.clustered_fraction = static_cast<double>(clustered) / pairs;
  o.clusters = components;
  o.energy = energy / (2.0 * beta * static_cast<double>(N) * static_cast<double>(N));
  o.diameter = std::sqrt(diameter_sq);
  return o;
}

template Observables observe<float>(const float*, std::int64_t, std::int64_t, double, double);
template Observables observe<double>(const double*, std::int64_t, std::int64_t, double, double);

}  // namespace emflow::flow
