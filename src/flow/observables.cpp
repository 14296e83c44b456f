// What the flow does to a cloud, in numbers (docs/MATH.md §5): pairwise inner products, the
// clustered pairs and their clusters, the interaction energy and the diameter. One pass over
// the pairs in double on the host, a row of pairs at a time: O(N d) memory, whatever N.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/check.hpp"
#include "emflow/flow.hpp"
#include "internal.hpp"

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

// Not under ThreadSanitizer: GCC instruments the clones' ifunc resolver, which then runs before
// the sanitizer's runtime is up and crashes the program at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define EMFLOW_OBSERVE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define EMFLOW_OBSERVE_CLONES
#endif

// The inner products and squared distances of token i with every later token j > i: the
// O(N d) inner part of the O(N^2 d) pass, compiled for AVX2 as well as the baseline, since the
// library is built without -march. Row by row, so the pass needs O(N) scratch rather than two
// arrays of N^2 / 2. Each pair's sums run over a in order, every product and sum rounded on its
// own (this file is compiled with -ffp-contract=off): the rounding rule the device's
// pair_rows_kernel follows too (kernels/flow_kernels.cu, compiled with -fmad=false), so the
// cluster decisions at the threshold agree bit for bit. Vectorised across j, never across a.
EMFLOW_OBSERVE_CLONES void row_products(const double* x, std::int64_t N, std::int64_t d,
                                        std::int64_t i, double* inner, double* distance_sq) {
  const double* xi = x + i * d;
#pragma omp simd
  for (std::int64_t j = i + 1; j < N; ++j) {
    const double* xj = x + j * d;
    double g = 0.0, e = 0.0;
    for (std::int64_t a = 0; a < d; ++a) {
      g += xi[a] * xj[a];
      e += (xi[a] - xj[a]) * (xi[a] - xj[a]);
    }
    inner[j - i - 1] = g;
    distance_sq[j - i - 1] = e;
  }
}

}  // namespace

namespace detail {

PairPart pair_part(const double* x, const double* norms, std::int64_t N, std::int64_t d,
                   double beta, double cluster_eps, const std::vector<RowRun>& rows) {
  PairPart part;
  Components graph(N);
  // The diagonal of the energy first, then the pairs: the order observe() has always summed in.
  for (const auto& [first, count] : rows) {
    for (std::int64_t i = first; i < first + count; ++i) {
      double square = 0.0;
      for (std::int64_t a = 0; a < d; ++a) square += x[i * d + a] * x[i * d + a];
      part.energy += std::exp(beta * square);
    }
  }
  // The pairs in the order (i, j > i), i ascending, as every sum below has always run: one row
  // of inner products and squared distances at a time, the clustered pairs joined as found.
  std::vector<double> inner(static_cast<std::size_t>(N)), distance_sq(inner.size());
  for (const auto& [first, count] : rows) {
    for (std::int64_t i = first; i < first + count && i + 1 < N; ++i) {
      row_products(x, N, d, i, inner.data(), distance_sq.data());
      const double norm_i = norms[static_cast<std::size_t>(i)];
      for (std::int64_t j = i + 1; j < N; ++j) {
        const auto p = static_cast<std::size_t>(j - i - 1);
        const double g = inner[p];
        part.min_inner = std::min(part.min_inner, g);
        part.sum_inner += g;
        part.diameter_sq = std::max(part.diameter_sq, distance_sq[p]);
        part.energy += 2.0 * std::exp(beta * g);
        // Clustering is about directions: the cosine, which is the inner product on the sphere.
        const double scale = norm_i * norms[static_cast<std::size_t>(j)];
        if (scale > 0.0 && g > (1.0 - cluster_eps) * scale) {
          ++part.clustered;
          if (graph.join(i, j)) ++part.joins;
        }
      }
    }
  }
  part.parent = std::move(graph.parent);
  return part;
}

std::vector<double> token_norms(const double* x, std::int64_t N, std::int64_t d) {
  std::vector<double> norms(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) {
    double square = 0.0;
    for (std::int64_t a = 0; a < d; ++a) square += x[i * d + a] * x[i * d + a];
    norms[static_cast<std::size_t>(i)] = std::sqrt(square);
  }
  return norms;
}

std::int64_t merged_joins(std::int64_t N, const std::vector<const std::int64_t*>& forests) {
  Components graph(N);
  std::int64_t joins = 0;
  for (const std::int64_t* parent : forests) {
    for (std::int64_t a = 0; a < N; ++a) joins += graph.join(a, parent[a]) ? 1 : 0;
  }
  return joins;
}

Observables finish_observables(const PairPart& sums, std::int64_t N, double beta) {
  Observables o;
  const std::int64_t pairs = N * (N - 1) / 2;  // exact: N (N - 1) is even
  const double pair_count = static_cast<double>(pairs);
  o.min_inner = sums.min_inner;
  o.mean_inner = sums.sum_inner / pair_count;
  o.clustered_fraction = static_cast<double>(sums.clustered) / pair_count;
  o.clusters = N - sums.joins;
  o.energy = sums.energy / (2.0 * beta * static_cast<double>(N) * static_cast<double>(N));
  o.diameter = std::sqrt(sums.diameter_sq);
  return o;
}

}  // namespace detail

template <class T>
Observables observe(const T* cloud, std::int64_t tokens, std::int64_t dim, double beta,
                    double cluster_eps) {
  if (tokens < 2) {
    emflow::detail::fail_argument("observe", "tokens", "must be >= 2, got ", tokens);
  }
  const std::int64_t N = tokens, d = dim;
  const std::vector<double> x(cloud, cloud + N * d);
  const std::vector<double> norms = detail::token_norms(x.data(), N, d);
  return detail::finish_observables(
      detail::pair_part(x.data(), norms.data(), N, d, beta, cluster_eps, {{0, N}}), N, beta);
}

template Observables observe<float>(const float*, std::int64_t, std::int64_t, double, double);
template Observables observe<double>(const double*, std::int64_t, std::int64_t, double, double);

}  // namespace emflow::flow
