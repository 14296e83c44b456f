// Properties that the EMF operations must have whatever the numbers (docs/MATH.md §1), checked on
// seeded random clouds and layers through the reference functions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "emflow/reference.hpp"
#include "reference/reference_helpers.hpp"

namespace emflow {
namespace {

using reference::Layer;
using testing::max_abs;
using testing::random_layer;
using testing::random_tensor;
using testing::tensors_near;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Scores of one head of a random layer on a random (B, N, d) cloud.
Tensor<double> random_scores(std::int64_t B, std::int64_t N, std::int64_t d, std::uint64_t seed,
                             const Mask& mask = {},
                             const std::vector<std::int64_t>& key_lengths = {}, double beta = 1.0) {
  const Tensor<double> X = random_tensor({B, N, d}, seed);
  const Tensor<double> M = random_tensor({d, d}, seed + 100, -1.5, 1.5);
  const Tensor<double> u = random_tensor({d}, seed + 200);
  return reference::scores(reference::relevance_gradients(X, M), X, u, beta, mask, key_lengths);
}

const Mask kMasks[] = {Mask::none(), Mask::causal(), Mask::sliding_window(1),
                       Mask::sliding_window(3)};

TEST(Properties, EveryWeightRowSumsToOne) {
  for (const Mask& mask : kMasks) {
    const reference::Softmax sm = reference::masked_softmax(random_scores(2, 9, 4, 1, mask));
    for (std::int64_t row = 0; row < 2 * 9; ++row) {
      double sum = 0.0;
      for (std::int64_t j = 0; j < 9; ++j) {
        const double p = sm.weights[row * 9 + j];
        EXPECT_GE(p, 0.0);
        sum += p;
      }
      EXPECT_NEAR(sum, 1.0, 1e-14) << "row " << row << " mask " << to_string(mask);
    }
  }
}

// softmax(s + a_i) = softmax(s): the weights and entropy do not move, lse moves by a_i.
TEST(Properties, PerQueryConstantChangesNothing) {
  for (const Mask& mask : kMasks) {
    const Tensor<double> S = random_scores(2, 7, 3, 2, mask);
    Tensor<double> shifted = S;
    const std::vector<double> a = testing::uniform(14, 99, -50.0, 50.0);
    for (std::int64_t row = 0; row < 14; ++row) {
      for (std::int64_t j = 0; j < 7; ++j) shifted[row * 7 + j] += a[row];  // -inf stays -inf
    }
    const reference::Softmax base = reference::masked_softmax(S);
    const reference::Softmax moved = reference::masked_softmax(shifted);
    EXPECT_TRUE(tensors_near(moved.weights, base.weights, 1e-13)) << to_string(mask);
    EXPECT_TRUE(tensors_near(moved.entropy, base.entropy, 1e-12)) << to_string(mask);
    for (std::int64_t row = 0; row < 14; ++row) {
      EXPECT_NEAR(moved.lse[row], base.lse[row] + a[row], 1e-12) << "row " << row;
    }
  }
}

// Huge scores are exponentiated after subtracting the row maximum: no overflow, no NaN.
TEST(Properties, HugeScoresStayFinite) {
  const Tensor<double> S({1, 3}, {1000.0, 1000.0 - std::log(3.0), -kInf});
  const reference::Softmax sm = reference::masked_softmax(S);
  EXPECT_TRUE(tensors_near(sm.weights, Tensor<double>({1, 3}, {0.75, 0.25, 0.0}), 1e-13));
  EXPECT_NEAR(sm.lse[0], 1000.0 + std::log(4.0 / 3.0), 1e-12);
  EXPECT_TRUE(std::isfinite(sm.entropy[0]));
}

// Without a mask the update is permutation equivariant: Delta(X[pi]) = Delta(X)[pi].
TEST(Properties, PermutingTokensPermutesTheUpdate) {
  const std::int64_t N = 8, d = 5;
  const Tensor<double> X = random_tensor({N, d}, 3);
  const Layer layer = random_layer(2, d, 3, true, true);
  const std::vector<std::int64_t> pi = {3, 7, 0, 5, 1, 6, 2, 4};
  Tensor<double> permuted({N, d});
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t a = 0; a < d; ++a) permuted[i * d + a] = X[pi[i] * d + a];
  }
  const reference::Attention base = reference::attend(X, layer);
  const reference::Attention moved = reference::attend(permuted, layer);
  ASSERT_GT(max_abs(base.update), 0.1);
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t a = 0; a < d; ++a) {
      EXPECT_NEAR(moved.update[i * d + a], base.update[pi[i] * d + a], 1e-13);
    }
    for (std::int64_t h = 0; h < 2; ++h) {
      EXPECT_NEAR(moved.lse[h * N + i], base.lse[h * N + pi[i]], 1e-13);
      EXPECT_NEAR(moved.entropy[h * N + i], base.entropy[h * N + pi[i]], 1e-13);
    }
  }
}

// Under a causal mask the first query sees only itself: p_00 = 1, lse_0 = s_00, H_0 = 0 and
// delta_0 = sum_h F_h x_0 + c.
TEST(Properties, FirstCausalQueryAttendsOnlyToItself) {
  const std::int64_t B = 2, N = 6, d = 3, H = 2;
  const Tensor<double> X = random_tensor({B, N, d}, 4);
  const Layer layer = random_layer(H, d, 4, true, true);
  const reference::Attention out =
      reference::attend(X, layer, 1.3, Mask::causal(), {}, /*with_weights=*/true);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t row = (b * H + h) * N;
      EXPECT_EQ(out.weights[row * N], 1.0);
      for (std::int64_t j = 1; j < N; ++j) EXPECT_EQ(out.weights[row * N + j], 0.0);
      EXPECT_EQ(out.entropy[row], 0.0);
    }
    for (std::int64_t a = 0; a < d; ++a) {
      double expected = layer.offset[a];
      for (std::int64_t h = 0; h < H; ++h) {
        for (std::int64_t k = 0; k < d; ++k) {
          expected += layer.content[(h * d + a) * d + k] * X[b * N * d + k];
        }
      }
      EXPECT_NEAR(out.update[b * N * d + a], expected, 1e-14);
    }
  }
}

// The window mask hides exactly the keys outside i - w < j <= i; a window at least N wide is
// the causal mask.
TEST(Properties, WindowMaskMatchesItsDefinition) {
  const std::int64_t N = 9;
  for (std::int64_t w : {1, 2, 4, 8, 9, 50}) {
    const Tensor<double> S = random_scores(1, N, 3, 5, Mask::sliding_window(w));
    const reference::Softmax sm = reference::masked_softmax(S);
    for (std::int64_t i = 0; i < N; ++i) {
      for (std::int64_t j = 0; j < N; ++j) {
        const bool inside = i - w < j && j <= i;
        EXPECT_EQ(S[i * N + j] != -kInf, inside) << "w " << w << " i " << i << " j " << j;
        EXPECT_EQ(sm.weights[i * N + j] > 0.0, inside) << "w " << w << " i " << i << " j " << j;
      }
    }
    if (w >= N) {
      EXPECT_TRUE(tensors_near(S, random_scores(1, N, 3, 5, Mask::causal()), 0.0));
    }
  }
}

// Key lengths: keys j >= L_b get weight 0, padding queries get 0 update, lse -inf and entropy 0,
// and the visible part equals the same cloud cut to its first L_b tokens.
TEST(Properties, KeyLengthsHidePaddingKeysAndQueries) {
  const std::int64_t B = 3, N = 7, d = 4, H = 2;
  const std::vector<std::int64_t> lengths = {7, 3, 1};
  const Tensor<double> X = random_tensor({B, N, d}, 6);
  const Layer layer = random_layer(H, d, 6, true, true);
  for (const Mask& mask : {Mask::none(), Mask::causal()}) {
    const reference::Attention out = reference::attend(X, layer, 1.0, mask, lengths, true);
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t L = lengths[b];
      const Tensor<double> cut({L, d}, std::vector<double>(X.values().begin() + b * N * d,
                                                           X.values().begin() + b * N * d + L * d));
      const reference::Attention alone = reference::attend(cut, layer, 1.0, mask);
      for (std::int64_t i = 0; i < N; ++i) {
        for (std::int64_t a = 0; a < d; ++a) {
          const double value = out.update[(b * N + i) * d + a];
          if (i >= L) {
            EXPECT_EQ(value, 0.0) << "padding query " << i << " of cloud " << b;
          } else {
            EXPECT_NEAR(value, alone.update[i * d + a], 1e-13);
          }
        }
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t row = (b * H + h) * N + i;
          if (i >= L) {
            EXPECT_EQ(out.lse[row], -kInf);
            EXPECT_EQ(out.entropy[row], 0.0);
          } else {
            EXPECT_NEAR(out.lse[row], alone.lse[h * L + i], 1e-13);
          }
          for (std::int64_t j = L; j < N; ++j) EXPECT_EQ(out.weights[row * N + j], 0.0);
        }
      }
    }
  }
}

// A query with no visible key: Delta = 0 (even with an offset), lse = -inf, entropy 0, no NaN.
TEST(Properties, FullyMaskedQueryGivesZeroUpdateAndNegativeInfiniteLse) {
  const Tensor<double> X = random_tensor({2, 4, 3}, 7);
  const Layer layer = random_layer(3, 3, 7, true, true);
  const reference::Attention out = reference::attend(X, layer, 2.0, {}, {0, 4}, true);
  for (std::int64_t e = 0; e < 4 * 3; ++e) EXPECT_EQ(out.update[e], 0.0);
  EXPECT_GT(max_abs(Tensor<double>({4, 3}, std::vector<double>(out.update.values().begin() + 12,
                                                               out.update.values().end()))),
            0.1);
  for (std::int64_t row = 0; row < 3 * 4; ++row) {
    EXPECT_EQ(out.lse[row], -kInf);
    EXPECT_EQ(out.entropy[row], 0.0);
  }
  for (double p : out.weights.values()) EXPECT_FALSE(std::isnan(p));
  for (double x : out.update.values()) EXPECT_FALSE(std::isnan(x));
  for (double x : out.entropy.values()) EXPECT_FALSE(std::isnan(x));

  // The softmax of an all -inf row on its own.
  const reference::Softmax sm =
      reference::masked_softmax(Tensor<double>({1, 3}, {-kInf, -kInf, -kInf}));
  EXPECT_TRUE(tensors_near(sm.weights, Tensor<double>({1, 3}, {0, 0, 0}), 0.0));
  EXPECT_EQ(sm.lse[0], -kInf);
  EXPECT_EQ(sm.entropy[0], 0.0);
}

// As beta grows the weights approach the hardmax (all mass on the top-scoring visible key),
// monotonically in distance.
TEST(Properties, LargeBetaApproachesHardmax) {
  const std::int64_t N = 6;
  const Tensor<double> base = random_scores(1, N, 4, 8, Mask::causal());
  double previous = kInf;
  for (double beta : {0.5, 2.0, 8.0, 32.0, 128.0, 1024.0}) {
    const Tensor<double> S = random_scores(1, N, 4, 8, Mask::causal(), {}, beta);
    const reference::Softmax sm = reference::masked_softmax(S);
    double distance = 0.0;
    for (std::int64_t i = 0; i < N; ++i) {
      const double* row = base.data() + i * N;
      const std::int64_t top = std::max_element(row, row + N) - row;
      for (std::int64_t j = 0; j < N; ++j) {
        distance = std::max(distance, std::abs(sm.weights[i * N + j] - (j == top ? 1.0 : 0.0)));
      }
    }
    EXPECT_LT(distance, previous) << "beta " << beta;
    previous = distance;
  }
  EXPECT_LT(previous, 1e-9);
}

// H_i = lse_i - sum_j p_ij s_ij equals the Shannon entropy -sum_j p_ij log p_ij, lies in
// [0, log(#visible keys)], and is ln(n) for n equal scores.
TEST(Properties, EntropyIsShannonEntropyOfTheWeights) {
  for (const Mask& mask : kMasks) {
    const std::int64_t N = 8;
    const reference::Softmax sm = reference::masked_softmax(random_scores(2, N, 3, 9, mask));
    for (std::int64_t row = 0; row < 2 * N; ++row) {
      double shannon = 0.0;
      std::int64_t visible = 0;
      for (std::int64_t j = 0; j < N; ++j) {
        const double p = sm.weights[row * N + j];
        if (p > 0.0) shannon -= p * std::log(p);
        visible += mask.allows(row % N, j) ? 1 : 0;
      }
      EXPECT_NEAR(sm.entropy[row], shannon, 1e-13) << "row " << row << " " << to_string(mask);
      EXPECT_GE(sm.entropy[row], -1e-15);
      EXPECT_LE(sm.entropy[row], std::log(static_cast<double>(visible)) + 1e-13);
    }
  }
  const reference::Softmax flat = reference::masked_softmax(Tensor<double>({4}, {2, 2, 2, 2}));
  EXPECT_NEAR(flat.entropy[0], std::log(4.0), 1e-15);
}

// Why softmax (docs/MATH.md §1): p_i minimises the free energy G(q) = -sum_j q_j s_ij +
// sum_j q_j log q_j over the simplex, with minimum -lse_i; any other distribution does worse.
TEST(Properties, WeightsMinimiseTheFreeEnergy) {
  const std::int64_t N = 7;
  const Tensor<double> S = random_scores(1, N, 3, 15, Mask::causal());
  const reference::Softmax sm = reference::masked_softmax(S);
  auto free_energy = [&](std::int64_t i, const std::vector<double>& q) {
    double g = 0.0;
    for (std::int64_t j = 0; j <= i; ++j) g += q[j] * (std::log(q[j]) - S[i * N + j]);
    return g;
  };
  for (std::int64_t i = 0; i < N; ++i) {
    std::vector<double> p(sm.weights.data() + i * N, sm.weights.data() + i * N + i + 1);
    EXPECT_NEAR(free_energy(i, p), -sm.lse[i], 1e-13) << "query " << i;
    if (i == 0) continue;  // one key: the simplex is a point
    const std::vector<double> noise = testing::uniform(static_cast<std::size_t>(i + 1), 40 + i);
    std::vector<double> q(p.size());
    double total = 0.0;
    for (std::size_t j = 0; j < q.size(); ++j) {
      q[j] = p[j] * std::exp(0.3 * noise[j]);
      total += q[j];
    }
    for (double& v : q) v /= total;
    EXPECT_GT(free_energy(i, q), free_energy(i, p)) << "query " << i;
  }
}

// Why the weighted average (docs/MATH.md §1): for one head without offset, delta_i minimises
// sum_j p_ij ||y - F x_j||^2 over y; the minimum is the weighted variance of the content, and
// moving y by e costs exactly ||e||^2.
TEST(Properties, UpdateIsTheWeightedLeastSquaresPoint) {
  const std::int64_t N = 6, d = 3;
  const Tensor<double> X = random_tensor({N, d}, 16);
  const Layer layer = random_layer(1, d, 16, true, false);
  const reference::Attention out = reference::attend(X, layer, 1.0, {}, {}, true);
  const Tensor<double> F({d, d}, layer.content.values());
  const Tensor<double> C = reference::content(X, F);
  const std::vector<double> e = testing::uniform(static_cast<std::size_t>(d), 17);
  for (std::int64_t i = 0; i < N; ++i) {
    auto cost = [&](const std::vector<double>& y) {
      double sum = 0.0;
      for (std::int64_t j = 0; j < N; ++j) {
        for (std::int64_t a = 0; a < d; ++a) {
          sum += out.weights[i * N + j] * std::pow(y[a] - C[j * d + a], 2);
        }
      }
      return sum;
    };
    std::vector<double> y(out.update.data() + i * d, out.update.data() + (i + 1) * d);
    const double at_update = cost(y);
    double norm2 = 0.0;
    for (std::int64_t a = 0; a < d; ++a) {
      y[a] += e[a];
      norm2 += e[a] * e[a];
    }
    EXPECT_NEAR(cost(y), at_update + norm2, 1e-13) << "query " << i;
  }
}

// With beta = 0 every visible key weighs the same: delta_i is F times the mean of the keys.
TEST(Properties, ZeroBetaAveragesTheContent) {
  const std::int64_t N = 5, d = 3;
  const Tensor<double> X = random_tensor({N, d}, 10);
  const Layer layer = random_layer(1, d, 10, true, false);
  const reference::Attention out = reference::attend(X, layer, 0.0);
  for (std::int64_t a = 0; a < d; ++a) {
    double mean = 0.0;
    for (std::int64_t j = 0; j < N; ++j) {
      for (std::int64_t k = 0; k < d; ++k) mean += layer.content[a * d + k] * X[j * d + k] / N;
    }
    for (std::int64_t i = 0; i < N; ++i) EXPECT_NEAR(out.update[i * d + a], mean, 1e-14);
  }
}

// Head h of a stacked layer as a layer of its own, without the offset.
Layer single_head(const Layer& layer, std::int64_t h, std::int64_t d) {
  auto slice = [h](const Tensor<double>& stacked, Shape shape) {
    const std::int64_t n = checked_element_count(shape);
    const auto first = stacked.values().begin() + h * n;
    return Tensor<double>(std::move(shape), std::vector<double>(first, first + n));
  };
  Layer one;
  one.relevance = slice(layer.relevance, {d, d});
  one.content = slice(layer.content, {d, d});
  one.key_bias = slice(layer.key_bias, {d});
  return one;
}

// Heads add: the update of a two-head layer is the sum of the two single-head updates, and the
// offset is added once per query, not once per head.
TEST(Properties, HeadsAddAndTheOffsetCountsOnce) {
  const std::int64_t N = 6, d = 4;
  const Tensor<double> X = random_tensor({N, d}, 11);
  const Layer both = random_layer(2, d, 11, true, true);
  const Tensor<double> first = reference::attend(X, single_head(both, 0, d)).update;
  const Tensor<double> second = reference::attend(X, single_head(both, 1, d)).update;
  const Tensor<double> together = reference::attend(X, both).update;
  for (std::int64_t i = 0; i < N; ++i) {
    for (std::int64_t a = 0; a < d; ++a) {
      const std::int64_t e = i * d + a;
      EXPECT_NEAR(together[e], first[e] + second[e] + both.offset[a], 1e-14);
    }
  }
}

TEST(Properties, ResidualUpdateAddsTheUpdate) {
  const Tensor<double> X = random_tensor({2, 3, 2}, 12);
  const Tensor<double> delta = random_tensor({2, 3, 2}, 13);
  const Tensor<double> next = reference::residual_update(X, delta);
  for (std::int64_t e = 0; e < X.size(); ++e) EXPECT_EQ(next[e], X[e] + delta[e]);
}

// An unbatched (N, d) cloud and the same cloud as a batch of one give the same numbers, and every
// function keeps the caller's rank.
TEST(Properties, UnbatchedCloudIsABatchOfOne) {
  const Tensor<double> X = random_tensor({5, 3}, 14);
  const Tensor<double> M = random_tensor({3, 3}, 15);
  const Tensor<double> R = reference::relevance_gradients(X, M);
  const Tensor<double> R1 = reference::relevance_gradients(X.reshaped({1, 5, 3}), M);
  EXPECT_EQ(R.shape(), (Shape{5, 3}));
  EXPECT_TRUE(tensors_near(R1, R.reshaped({1, 5, 3}), 0.0));
  const Tensor<double> S = reference::scores(R, X, {}, 1.0);
  EXPECT_EQ(S.shape(), (Shape{5, 5}));
  const Layer layer = random_layer(2, 3, 14, true, true);
  const reference::Attention a = reference::attend(X, layer);
  const reference::Attention b = reference::attend(X.reshaped({1, 5, 3}), layer);
  EXPECT_EQ(a.update.shape(), (Shape{5, 3}));
  EXPECT_EQ(a.lse.shape(), (Shape{1, 2, 5}));
  EXPECT_TRUE(tensors_near(b.update, a.update.reshaped({1, 5, 3}), 0.0));
}

}  // namespace
}  // namespace emflow
