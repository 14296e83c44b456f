// observe() streams over the pairs a row at a time with O(N d) memory; its results must be bit
// for bit those of the earlier all-pairs pass, which kept two arrays of N (N - 1) / 2 doubles.
// That pass is copied here as the oracle, on small clouds.
//
// The inner products of a pair are sums over the d coordinates that the library vectorises and
// compiles for AVX2 with FMA as well as the baseline (the rounding of a sum of d > 1 products
// then depends on the machine), while this suite is compiled without OpenMP and for the baseline
// only. So the clouds are chosen to make every per-pair sum exact however it is evaluated: d = 1
// (one product, rounded once whether fused or not), or small integer coordinates (every product
// and sum an exact integer). The sums over the pairs (the energy always, the mean inner product
// for d = 1) still depend on the order of the pairs, which is what the comparison holds fixed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "emflow/flow.hpp"

namespace emflow::flow {
namespace {

// ---- The oracle: the all-pairs pass as it was (its sums unchanged), components by search. ----

// Components counted by a depth-first search over the clustered pairs: a different algorithm
// from the library's union-find, so the two check each other.
std::int64_t count_components(std::int64_t n, const std::vector<std::vector<std::int64_t>>& edges) {
  std::vector<char> seen(static_cast<std::size_t>(n), 0);
  std::vector<std::int64_t> stack;
  std::int64_t components = 0;
  for (std::int64_t start = 0; start < n; ++start) {
    if (seen[static_cast<std::size_t>(start)]) continue;
    ++components;
    seen[static_cast<std::size_t>(start)] = 1;
    stack.assign(1, start);
    while (!stack.empty()) {
      const std::int64_t at = stack.back();
      stack.pop_back();
      for (std::int64_t next : edges[static_cast<std::size_t>(at)]) {
        if (!seen[static_cast<std::size_t>(next)]) {
          seen[static_cast<std::size_t>(next)] = 1;
          stack.push_back(next);
        }
      }
    }
  }
  return components;
}

void oracle_pair_products(const double* x, std::int64_t N, std::int64_t d, double* inner,
                          double* distance_sq) {
  std::int64_t p = 0;
  for (std::int64_t i = 0; i < N; ++i) {
    const double* xi = x + i * d;
    for (std::int64_t j = i + 1; j < N; ++j, ++p) {
      const double* xj = x + j * d;
      double g = 0.0, e = 0.0;
      for (std::int64_t a = 0; a < d; ++a) {
        g += xi[a] * xj[a];
        e += (xi[a] - xj[a]) * (xi[a] - xj[a]);
      }
      inner[p] = g;
      distance_sq[p] = e;
    }
  }
}

template <class T>
Observables oracle_observe(const T* cloud, std::int64_t tokens, std::int64_t dim, double beta,
                           double cluster_eps) {
  const std::int64_t N = tokens, d = dim;
  const std::vector<double> x(cloud, cloud + N * d);
  const auto pairs = static_cast<std::size_t>(N * (N - 1) / 2);
  std::vector<double> inner(pairs), distance_sq(pairs);
  oracle_pair_products(x.data(), N, d, inner.data(), distance_sq.data());

  std::vector<double> norms(static_cast<std::size_t>(N));
  double energy = 0.0;
  for (std::int64_t i = 0; i < N; ++i) {
    const double* xi = x.data() + i * d;
    const double square = std::inner_product(xi, xi + d, xi, 0.0);  // summed in order, as before
    norms[static_cast<std::size_t>(i)] = std::sqrt(square);
    energy += std::exp(beta * square);
  }

  Observables o;
  o.min_inner = std::numeric_limits<double>::infinity();
  double sum_inner = 0.0, diameter_sq = 0.0;
  std::int64_t clustered = 0;
  std::vector<std::vector<std::int64_t>> edges(static_cast<std::size_t>(N));
  std::size_t p = 0;
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t j = i + 1; j < N; ++j, ++p) {
      const double g = inner[p];
      o.min_inner = std::min(o.min_inner, g);
      sum_inner += g;
      diameter_sq = std::max(diameter_sq, distance_sq[p]);
      energy += 2.0 * std::exp(beta * g);
      const double scale = norms[static_cast<std::size_t>(i)] * norms[static_cast<std::size_t>(j)];
      if (scale > 0.0 && g > (1.0 - cluster_eps) * scale) {
        ++clustered;
        edges[static_cast<std::size_t>(i)].push_back(j);
        edges[static_cast<std::size_t>(j)].push_back(i);
      }
    }
  }
  const double pair_count = static_cast<double>(pairs);
  o.mean_inner = sum_inner / pair_count;
  o.clustered_fraction = static_cast<double>(clustered) / pair_count;
  o.clusters = count_components(N, edges);
  o.energy = energy / (2.0 * beta * static_cast<double>(N) * static_cast<double>(N));
  o.diameter = std::sqrt(diameter_sq);
  return o;
}

// ---- The comparison ----

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void expect_bitwise(const Observables& got, const Observables& want, const std::string& what) {
  EXPECT_TRUE(same_bits(got.min_inner, want.min_inner)) << what << ": " << got.min_inner;
  EXPECT_TRUE(same_bits(got.mean_inner, want.mean_inner)) << what << ": " << got.mean_inner;
  EXPECT_TRUE(same_bits(got.clustered_fraction, want.clustered_fraction))
      << what << ": " << got.clustered_fraction;
  EXPECT_EQ(got.clusters, want.clusters) << what;
  EXPECT_TRUE(same_bits(got.energy, want.energy)) << what << ": " << got.energy;
  EXPECT_TRUE(same_bits(got.diameter, want.diameter)) << what << ": " << got.diameter;
}

// Tokens in a few tight groups of directions (so there are clustered pairs and several
// clusters) in random order, the rest spread out.
template <class T>
std::vector<T> grouped_cloud(std::int64_t N, std::int64_t d, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> group(0, 5);
  std::vector<double> centres(static_cast<std::size_t>(6 * d));
  for (double& c : centres) c = normal(rng);
  std::vector<T> x(static_cast<std::size_t>(N * d));
  for (std::int64_t i = 0; i < N; ++i) {
    const int g = group(rng);
    const double radius = 0.5 + std::abs(normal(rng));
    for (std::int64_t a = 0; a < d; ++a) {
      // Groups 0 to 3 tight (clustered), 4 and 5 spread out.
      const double spread = g < 4 ? 1e-3 : 1.0;
      x[static_cast<std::size_t>(i * d + a)] = static_cast<T>(
          radius * centres[static_cast<std::size_t>(g * d + a)] + spread * normal(rng));
    }
  }
  return x;
}

// Small integer coordinates: every product and every sum over the d coordinates exact. Half the
// tokens are integer multiples of a few base directions (clustered exactly), the rest random.
std::vector<double> integer_cloud(std::int64_t N, std::int64_t d, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> small(-3, 3), multiple(1, 3), base(0, 4), coin(0, 1);
  std::vector<double> bases(static_cast<std::size_t>(5 * d));
  for (double& b : bases) b = small(rng);
  bases[0] = 1.0;  // no zero base direction
  std::vector<double> x(static_cast<std::size_t>(N * d));
  for (std::int64_t i = 0; i < N; ++i) {
    const bool aligned = coin(rng) == 1;
    const int b = base(rng), k = multiple(rng);
    for (std::int64_t a = 0; a < d; ++a) {
      x[static_cast<std::size_t>(i * d + a)] =
          aligned ? k * bases[static_cast<std::size_t>(b * d + a)] : small(rng);
    }
  }
  return x;
}

// Real coordinates in d = 1: two clusters (the signs), pair sums in real arithmetic.
TEST(ObserveTiles, MatchesTheAllPairsPassBitwiseOnRandomClouds) {
  constexpr std::int64_t d = 1;
  for (const std::int64_t N : {2, 3, 17, 64, 129, 300}) {
    for (const std::uint64_t seed : {1u, 2u}) {
      const std::string what = "N " + std::to_string(N) + " seed " + std::to_string(seed);
      const auto xd = grouped_cloud<double>(N, d, seed);
      const Observables want = oracle_observe(xd.data(), N, d, 0.7, 1e-3);
      if (N >= 64) {
        ASSERT_GT(want.clustered_fraction, 0.0) << what;  // not vacuous
        ASSERT_EQ(want.clusters, 2) << what;
      }
      expect_bitwise(observe(xd.data(), N, d, 0.7, 1e-3), want, what + " double");
      const auto xf = grouped_cloud<float>(N, d, seed);
      expect_bitwise(observe(xf.data(), N, d, 2.0, 1e-2),
                     oracle_observe(xf.data(), N, d, 2.0, 1e-2), what + " float");
    }
  }
}

// Integer coordinates in higher dimensions: many clusters (the multiples of each base direction
// and the random tokens that happen to align), every per-pair sum exact.
TEST(ObserveTiles, MatchesTheAllPairsPassBitwiseInHigherDimensions) {
  for (const std::int64_t d : {3, 7, 16, 64}) {
    for (const std::int64_t N : {5, 100, 257}) {
      const std::string what = "N " + std::to_string(N) + " d " + std::to_string(d);
      const auto x = integer_cloud(N, d, static_cast<std::uint64_t>(N * 131 + d));
      // beta small enough that exp(beta <x_i, x_j>) stays finite for these coordinates.
      const double beta = 0.5 / static_cast<double>(d);
      const Observables want = oracle_observe(x.data(), N, d, beta, 1e-3);
      ASSERT_TRUE(std::isfinite(want.energy)) << what;
      if (N >= 100) {
        ASSERT_GT(want.clustered_fraction, 0.0) << what;
        ASSERT_GT(want.clusters, 1) << what;
        ASSERT_LT(want.clusters, N) << what;
      }
      expect_bitwise(observe(x.data(), N, d, beta, 1e-3), want, what);
    }
  }
}

// A chain of tokens whose neighbours along a circle are clustered but whose second neighbours
// are not, visited in scrambled token order: one component only through many joins of roots.
TEST(ObserveTiles, LongChainInScrambledOrderIsOneCluster) {
  constexpr std::int64_t N = 400, d = 2;
  std::vector<std::int64_t> order(N);
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::shuffle(order.begin(), order.end(), std::mt19937_64(5));
  // Consecutive angles 0.01 apart on a half circle: cos 0.01 > 1 - 1e-4 > cos 0.02.
  std::vector<double> x(static_cast<std::size_t>(N * d));
  for (std::int64_t k = 0; k < N; ++k) {
    const double angle = 0.01 * static_cast<double>(k);
    x[static_cast<std::size_t>(order[k] * d)] = std::cos(angle);
    x[static_cast<std::size_t>(order[k] * d + 1)] = std::sin(angle);
  }
  const Observables got = observe(x.data(), N, d, 1.0, 1e-4);
  EXPECT_EQ(got.clusters, 1);
  EXPECT_EQ(got.clustered_fraction,
            static_cast<double>(N - 1) / static_cast<double>(N * (N - 1) / 2));
  EXPECT_EQ(got.clusters, oracle_observe(x.data(), N, d, 1.0, 1e-4).clusters);
}

}  // namespace
}  // namespace emflow::flow
