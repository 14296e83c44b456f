// The reference backward pass (docs/MATH.md §8, src/reference/backward.cpp) against central
// differences of forward passes in double, and against identities that need no differences.
//
// Every gradient is held to the derivative of a loss L = <dO, O> + <dlse, lse> + <dH, H> with
// fixed random upstream weights, computed by Richardson-extrapolated central differences of an
// independent forward: sdpa_attend for the SDPA-shaped operator, and emflow::attend and
// emflow::attend_factored on Device::reference (src/reference/attend.cpp, which shares no code
// with backward.cpp) for the dense and factored layers.
//
// The bound. With D(h) = (L(x + h) - L(x - h)) / 2h, the extrapolation (4 D(h/2) - D(h)) / 3
// has a truncation error of order h^4 |L^(5)| / 480 and a rounding error of about
// 3 eps |L| / h. At h = 1e-3, with |L| <= 100 and derivatives of L of order 10 or less (entries
// in [-1, 1], scores of order 1 to 3), that is below 1e-10, against a bound of 1e-7 of the largest
// entry of the gradient: the margin covers derivatives 1000 times larger, while a missing term,
// a wrong sign or a wrong head pairing changes a gradient by far more than 1e-7 (a test below
// checks that the comparison fails for a gradient off by 1e-5). Measured, the largest error over
// every case is about 1e-10.
//
// Rows that see no key get NaN upstream gradients and padding rows hold NaN inputs in the edge
// tests: the backward must not read them, and their gradients are checked to be exact zeros.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/factored.hpp"
#include "emflow/reference.hpp"
#include "reference/reference_helpers.hpp"

namespace emflow {
namespace {

using reference::OutputGradients;
using reference::Visibility;
using testing::random_layer;
using testing::random_tensor;
using testing::tensors_near;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kBound = 1e-7;  // see the top of this file

// ---------------------------------------------------------------------------------------------
// Finite differences

/// dL/dx by Richardson-extrapolated central differences: (4 D(h/2) - D(h)) / 3 with
/// D(h) = (L(x + h) - L(x - h)) / 2h; `x` restored.
double numeric_derivative(double& x, const std::function<double()>& loss, double h) {
  const double x0 = x;
  auto central = [&](double step) {
    x = x0 + step;
    const double up = loss();
    x = x0 - step;
    const double down = loss();
    x = x0;
    return (up - down) / (2 * step);
  };
  return (4 * central(h / 2) - central(h)) / 3;
}

/// dL/dx_e for every element of `x`, as numeric_derivative.
Tensor<double> numeric_gradient(Tensor<double>& x, const std::function<double()>& loss, double h) {
  Tensor<double> g(x.shape());
  for (std::int64_t e = 0; e < x.size(); ++e) g[e] = numeric_derivative(x[e], loss, h);
  return g;
}

/// max_e |analytic_e - numeric_e| <= kBound * max_e |analytic_e| (both exactly zero passes: a
/// gradient the loss does not depend on). Names the worst element.
::testing::AssertionResult matches_differences(const Tensor<double>& analytic,
                                               const Tensor<double>& numeric) {
  if (analytic.shape() != numeric.shape()) {
    return ::testing::AssertionFailure() << "shapes differ: " << to_string(analytic.shape())
                                         << " vs " << to_string(numeric.shape());
  }
  double scale = 0.0, worst = 0.0;
  std::int64_t worst_at = 0;
  for (std::int64_t e = 0; e < analytic.size(); ++e) {
    if (!std::isfinite(analytic[e])) {
      return ::testing::AssertionFailure() << "element " << e << " is " << analytic[e];
    }
    scale = std::max(scale, std::abs(analytic[e]));
    const double error = std::abs(analytic[e] - numeric[e]);
    if (!(error <= worst)) {
      worst = error;
      worst_at = e;
    }
  }
  if (!(worst <= kBound * scale) && !(worst == 0.0)) {
    return ::testing::AssertionFailure()
           << "element " << worst_at << ": " << analytic[worst_at] << " vs differences "
           << numeric[worst_at] << ", error " << worst << " > " << kBound << " * " << scale;
  }
  return ::testing::AssertionSuccess() << "error " << worst << " of scale " << scale;
}

::testing::AssertionResult matches_difference(double analytic, double numeric) {
  return matches_differences(Tensor<double>({1}, {analytic}), Tensor<double>({1}, {numeric}));
}

// ---------------------------------------------------------------------------------------------
// Upstream gradients and the loss

enum class Through { update, lse, entropy, all };

const char* to_string(Through t) {
  switch (t) {
    case Through::update:
      return "update";
    case Through::lse:
      return "lse";
    case Through::entropy:
      return "entropy";
    case Through::all:
      return "all";
  }
  return "?";
}

/// For each row of an update-shaped array, whether its query sees a key: B * H * Nq rows for the
/// SDPA shape, B * Nq for a layer's update (whose heads all see the same keys). Read from the
/// forward's lse (B, H, Nq), which is -inf exactly for the queries without keys.
std::vector<bool> rows_with_keys(const Tensor<double>& lse, std::int64_t rows) {
  const std::int64_t H = lse.extent(1), Nq = lse.extent(2);
  std::vector<bool> sees(static_cast<std::size_t>(rows));
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int64_t stat = rows == lse.size() ? row : (row / Nq) * H * Nq + row % Nq;
    sees[static_cast<std::size_t>(row)] = lse[stat] != -kInf;
  }
  return sees;
}

/// `t` with NaN on the rows (of `width` elements) whose query sees no key.
Tensor<double> nan_without_keys(Tensor<double> t, std::int64_t width, const Tensor<double>& lse) {
  const std::int64_t rows = t.size() / width;
  const std::vector<bool> sees = rows_with_keys(lse, rows);
  for (std::int64_t row = 0; row < rows; ++row) {
    if (sees[static_cast<std::size_t>(row)]) continue;
    for (std::int64_t a = 0; a < width; ++a) t[row * width + a] = kNaN;
  }
  return t;
}

/// Random upstream gradients of the outputs `through` selects, NaN on the rows of queries that
/// see no key: the backward must not read them.
OutputGradients random_upstream(Through through, const Shape& update_shape,
                                const Tensor<double>& forward_lse, std::uint64_t seed) {
  const std::int64_t width = update_shape.back();
  OutputGradients up;
  if (through == Through::update || through == Through::all) {
    up.update = nan_without_keys(random_tensor(update_shape, seed * 7 + 1), width, forward_lse);
  }
  if (through == Through::lse || through == Through::all) {
    up.lse = nan_without_keys(random_tensor(forward_lse.shape(), seed * 7 + 2), 1, forward_lse);
  }
  if (through == Through::entropy || through == Through::all) {
    up.entropy = nan_without_keys(random_tensor(forward_lse.shape(), seed * 7 + 3), 1, forward_lse);
  }
  return up;
}

/// sum of weight * value over the rows (of `width` elements) whose query sees a key (the others
/// have constant outputs and NaN weights); absent weights give 0.
double weighted_sum(const Tensor<double>& weights, const Tensor<double>& values, std::int64_t width,
                    const Tensor<double>& lse) {
  if (reference::absent(weights)) return 0.0;
  const std::int64_t rows = values.size() / width;
  const std::vector<bool> sees = rows_with_keys(lse, rows);
  double sum = 0.0;
  for (std::int64_t row = 0; row < rows; ++row) {
    if (!sees[static_cast<std::size_t>(row)]) continue;
    for (std::int64_t a = 0; a < width; ++a) {
      sum += weights[row * width + a] * values[row * width + a];
    }
  }
  return sum;
}

/// L = <dO, O> + <dlse, lse> + <dH, H> over the rows that see a key.
double loss_of(const OutputGradients& up, const Tensor<double>& update, const Tensor<double>& lse,
               const Tensor<double>& entropy) {
  return weighted_sum(up.update, update, update.extent(update.rank() - 1), lse) +
         weighted_sum(up.lse, lse, 1, lse) + weighted_sum(up.entropy, entropy, 1, lse);
}

// ---------------------------------------------------------------------------------------------
// The SDPA-shaped operator

struct SdpaCase {
  std::string name;
  std::int64_t batch, query_heads, kv_heads, queries, keys, rank, value_rank;
  Visibility visibility;
  double scale = 0.8;
};

std::ostream& operator<<(std::ostream& out, const SdpaCase& c) { return out << c.name; }

Visibility masked(Mask mask) {
  Visibility v;
  v.mask = mask;
  return v;
}

Visibility with_lengths(Mask mask, std::vector<std::int64_t> keys,
                        std::vector<std::int64_t> queries) {
  Visibility v = masked(mask);
  v.key_lengths = std::move(keys);
  v.query_lengths = std::move(queries);
  return v;
}

Visibility at_positions(Mask mask, std::int64_t key_position,
                        std::vector<std::int64_t> query_positions) {
  Visibility v = masked(mask);
  v.key_position = key_position;
  v.query_positions = std::move(query_positions);
  return v;
}

std::vector<SdpaCase> sdpa_cases() {
  return {
      {"h6_kv2_none", 2, 6, 2, 5, 5, 3, 2, masked(Mask::none())},
      {"h6_kv1_causal", 2, 6, 1, 5, 5, 3, 2, masked(Mask::causal())},
      {"h6_kv2_window2", 1, 6, 2, 6, 6, 2, 3, masked(Mask::sliding_window(2))},
      // Self-attention shape with key lengths: padding queries and an empty cloud.
      {"h6_kv2_causal_lengths_padding_empty", 3, 6, 2, 5, 5, 2, 2,
       with_lengths(Mask::causal(), {5, 3, 0}, {5, 3, 0})},
      {"h2_none_lengths_padding", 2, 2, 2, 4, 4, 3, 3, with_lengths(Mask::none(), {4, 2}, {4, 2})},
      // Cross-attention, explicit positions: cloud 0's first query sits before every key.
      {"h6_kv2_cross_causal_positions", 2, 6, 2, 3, 6, 3, 2,
       at_positions(Mask::causal(), 4, {3, 9}), 1.1},
      {"h4_kv2_cross_window_positions", 2, 4, 2, 4, 7, 2, 2,
       at_positions(Mask::sliding_window(3), -2, {1, 0})},
      // Cross-attention aligned bottom-right with key and query lengths.
      {"h6_kv1_cross_window_lengths", 2, 6, 1, 3, 7, 2, 3,
       with_lengths(Mask::sliding_window(3), {7, 4}, {3, 1})},
      {"h3_kv3_negative_scale", 1, 3, 3, 4, 6, 3, 2, masked(Mask::none()), -1.3},
      {"h2_kv1_value_rank_above_rank", 1, 2, 1, 4, 4, 2, 5, masked(Mask::causal())},
  };
}

struct SdpaProblem {
  Tensor<double> Q, K, V;
  double scale;
  Visibility visibility;

  explicit SdpaProblem(const SdpaCase& c, std::uint64_t seed = 1)
      : Q(random_tensor({c.batch, c.query_heads, c.queries, c.rank}, seed * 13 + 1)),
        K(random_tensor({c.batch, c.kv_heads, c.keys, c.rank}, seed * 13 + 2)),
        V(random_tensor({c.batch, c.kv_heads, c.keys, c.value_rank}, seed * 13 + 3)),
        scale(c.scale),
        visibility(c.visibility) {}

  reference::SdpaAttention forward() const {
    return reference::sdpa_attend(Q, K, V, scale, visibility);
  }
  reference::SdpaGradients backward(const OutputGradients& up) const {
    return reference::sdpa_backward(Q, K, V, scale, visibility, up);
  }
  double loss(const OutputGradients& up) const {
    const reference::SdpaAttention f = forward();
    return loss_of(up, f.output, f.lse, f.entropy);
  }
  OutputGradients upstream(Through through, std::uint64_t seed = 5) const {
    const reference::SdpaAttention f = forward();
    return random_upstream(through, f.output.shape(), f.lse, seed);
  }
};

class SdpaBackward : public ::testing::TestWithParam<std::tuple<SdpaCase, Through>> {};

TEST_P(SdpaBackward, GradientsMatchCentralDifferences) {
  const auto& [c, through] = GetParam();
  SdpaProblem p(c);
  const OutputGradients up = p.upstream(through);
  const reference::SdpaGradients g = p.backward(up);
  auto loss = [&] { return p.loss(up); };
  const double h = 1e-3;

  ASSERT_GT(testing::max_abs(g.queries), 1e-3) << "a vacuous comparison";
  EXPECT_TRUE(matches_differences(g.queries, numeric_gradient(p.Q, loss, h))) << "dQ";
  EXPECT_TRUE(matches_differences(g.keys, numeric_gradient(p.K, loss, h))) << "dK";
  EXPECT_TRUE(matches_differences(g.values, numeric_gradient(p.V, loss, h))) << "dV";
  EXPECT_TRUE(matches_difference(g.scale, numeric_derivative(p.scale, loss, h))) << "dscale";
  if (through == Through::lse || through == Through::entropy) {
    EXPECT_EQ(testing::max_abs(g.values), 0.0) << "lse and entropy do not depend on V";
  }
}

// Identities that need no differences (docs/MATH.md §8.2, §8.3).
TEST_P(SdpaBackward, IdentitiesHold) {
  const auto& [c, through] = GetParam();
  const SdpaProblem p(c);
  const OutputGradients up = p.upstream(through);
  const reference::SdpaGradients g = p.backward(up);
  const reference::SdpaAttention f = p.forward();
  const std::int64_t B = c.batch, H = c.query_heads, Hkv = c.kv_heads, Nq = c.queries, Nk = c.keys,
                     rv = c.value_rank, group = H / Hkv;
  ASSERT_GT(testing::max_abs(g.scores), 1e-3) << "a vacuous comparison";

  // sum_j dS_ij = dlse_i (0 without the lse term; the entropy term sums to 0 too); dS = 0 on
  // masked pairs and on the rows of queries without keys.
  for (std::int64_t row = 0; row < B * H * Nq; ++row) {
    double sum = 0.0;
    for (std::int64_t j = 0; j < Nk; ++j) {
      const double dS = g.scores[row * Nk + j];
      sum += dS;
      if (f.lse[row] == -kInf) {
        EXPECT_EQ(dS, 0.0) << "row " << row << " without keys";
      }
    }
    const double dlse = reference::absent(up.lse) || f.lse[row] == -kInf ? 0.0 : up.lse[row];
    EXPECT_NEAR(sum, dlse, 1e-13) << "row " << row;
  }

  // sum_j dV_j of a key and value head = sum of dO_i over its query heads' rows that see a key.
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t kv = 0; kv < Hkv; ++kv) {
      for (std::int64_t a = 0; a < rv; ++a) {
        double keys_side = 0.0, queries_side = 0.0;
        for (std::int64_t j = 0; j < Nk; ++j)
          keys_side += g.values[((b * Hkv + kv) * Nk + j) * rv + a];
        for (std::int64_t h = kv * group; h < (kv + 1) * group && !reference::absent(up.update);
             ++h) {
          for (std::int64_t i = 0; i < Nq; ++i) {
            if (f.lse[(b * H + h) * Nq + i] == -kInf) continue;
            queries_side += up.update[((b * H + h) * Nq + i) * rv + a];
          }
        }
        EXPECT_NEAR(keys_side, queries_side, 1e-12);
      }
    }
  }

  // The scores are bilinear in (q_i, k_j): scale * dscale = sum <dQ, Q> = sum <dK, K>.
  double q_side = 0.0, k_side = 0.0;
  for (std::int64_t e = 0; e < p.Q.size(); ++e) q_side += g.queries[e] * p.Q[e];
  for (std::int64_t e = 0; e < p.K.size(); ++e) k_side += g.keys[e] * p.K[e];
  EXPECT_NEAR(q_side, c.scale * g.scale, 1e-12 * std::max(1.0, std::abs(q_side)));
  EXPECT_NEAR(k_side, c.scale * g.scale, 1e-12 * std::max(1.0, std::abs(k_side)));
}

/// Keys [first, first + count) of a (B, Hkv, Nk, w) array.
Tensor<double> key_block(const Tensor<double>& whole, std::int64_t first, std::int64_t count) {
  const std::int64_t B = whole.extent(0), Hkv = whole.extent(1), Nk = whole.extent(2),
                     w = whole.extent(3);
  Tensor<double> part({B, Hkv, count, w});
  for (std::int64_t bh = 0; bh < B * Hkv; ++bh) {
    for (std::int64_t j = 0; j < count; ++j) {
      for (std::int64_t a = 0; a < w; ++a) {
        part[(bh * count + j) * w + a] = whole[(bh * Nk + first + j) * w + a];
      }
    }
  }
  return part;
}

// With the statistics of the whole key set given, the backward over each block of the keys is
// that block's share (docs/MATH.md §8.9): dK and dV block by block, dQ and dscale summed.
TEST_P(SdpaBackward, BlocksOfKeysWithTheWholeStatisticsSumToTheWhole) {
  const auto& [c, through] = GetParam();
  const SdpaProblem p(c);
  const OutputGradients up = p.upstream(through);
  const reference::SdpaGradients whole = p.backward(up);
  const reference::SdpaAttention f = p.forward();
  ASSERT_GT(testing::max_abs(whole.queries), 1e-3) << "a vacuous comparison";

  // The saved form over all the keys is the recomputing one.
  const reference::SdpaGradients saved =
      reference::sdpa_backward(p.Q, p.K, p.V, p.scale, p.visibility, up, f);
  EXPECT_TRUE(testing::close_to(saved.queries.values(), whole.queries.values(), 1e-13)) << "dQ";
  EXPECT_TRUE(testing::close_to(saved.keys.values(), whole.keys.values(), 1e-13)) << "dK";
  EXPECT_TRUE(testing::close_to(saved.values.values(), whole.values.values(), 1e-13)) << "dV";

  // Two blocks, their visibility the whole one's at the blocks' positions.
  const std::int64_t Nk = c.keys, Nq = c.queries, split = Nk / 2;
  if (split == 0) GTEST_SKIP() << "one key: no second block";
  const Visibility& v = p.visibility;
  Tensor<double> dQ(p.Q.shape());
  double dscale = 0.0;
  for (const auto& [first, count] : {std::pair{std::int64_t{0}, split}, {split, Nk - split}}) {
    Visibility block = v;
    block.key_position = v.key_position + first;
    block.query_position = kAlignToEnd;
    block.query_positions.clear();
    block.key_lengths.clear();
    for (std::int64_t b = 0; b < c.batch; ++b) {
      const std::int64_t Lk = v.key_lengths.empty() ? Nk : v.key_lengths[static_cast<size_t>(b)];
      const std::int64_t Lq =
          v.query_lengths.empty() ? Nq : v.query_lengths[static_cast<size_t>(b)];
      std::int64_t position = v.key_position + Lk - Lq;
      if (!v.query_positions.empty()) {
        position = v.query_positions[static_cast<size_t>(b)];
      } else if (v.query_position != kAlignToEnd) {
        position = v.query_position;
      }
      block.query_positions.push_back(position);
      if (!v.key_lengths.empty())
        block.key_lengths.push_back(std::clamp(Lk - first, std::int64_t{0}, count));
    }
    const reference::SdpaGradients g = reference::sdpa_backward(
        p.Q, key_block(p.K, first, count), key_block(p.V, first, count), p.scale, block, up, f);
    EXPECT_TRUE(
        testing::close_to(g.keys.values(), key_block(whole.keys, first, count).values(), 1e-12))
        << "dK of the block at " << first;
    EXPECT_TRUE(
        testing::close_to(g.values.values(), key_block(whole.values, first, count).values(), 1e-12))
        << "dV of the block at " << first;
    for (std::int64_t e = 0; e < dQ.size(); ++e) dQ[e] += g.queries[e];
    dscale += g.scale;
  }
  EXPECT_TRUE(testing::close_to(dQ.values(), whole.queries.values(), 1e-12)) << "dQ summed";
  EXPECT_NEAR(dscale, whole.scale, 1e-12 * std::max(1.0, std::abs(whole.scale))) << "dscale";
}

INSTANTIATE_TEST_SUITE_P(Cases, SdpaBackward,
                         ::testing::Combine(::testing::ValuesIn(sdpa_cases()),
                                            ::testing::Values(Through::update, Through::lse,
                                                              Through::entropy, Through::all)),
                         [](const ::testing::TestParamInfo<std::tuple<SdpaCase, Through>>& info) {
                           return std::get<0>(info.param).name + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// The dense and factored layers

struct LayerCase {
  std::string name;
  std::int64_t batch, tokens, query_tokens /* 0: self-attention */, dim, heads, rank;
  Visibility visibility;
  bool key_bias, offset;
  double beta = 1.0;
  bool batched = true;
};

std::ostream& operator<<(std::ostream& out, const LayerCase& c) { return out << c.name; }

std::vector<LayerCase> layer_cases() {
  return {
      {"b2_n6_d3_h2_none_bias_offset", 2, 6, 0, 3, 2, 2, masked(Mask::none()), true, true},
      {"b2_n6_d4_h2_causal", 2, 6, 0, 4, 2, 3, masked(Mask::causal()), false, false},
      {"b1_n7_d3_h3_window3_bias", 1, 7, 0, 3, 3, 2, masked(Mask::sliding_window(3)), true, false},
      {"b3_n5_d3_h2_causal_lengths_padding_empty", 3, 5, 0, 3, 2, 2,
       with_lengths(Mask::causal(), {5, 3, 0}, {}), true, true},
      {"b2_n5_d3_none_lengths_padding", 2, 5, 0, 3, 1, 2, with_lengths(Mask::none(), {5, 2}, {}),
       true, true},
      {"cross_b2_nq3_n6_causal_positions", 2, 6, 3, 3, 2, 2,
       at_positions(Mask::causal(), 2, {1, 6}), true, true},
      {"cross_b2_nq3_n7_window2_lengths", 2, 7, 3, 3, 2, 2,
       with_lengths(Mask::sliding_window(2), {7, 4}, {3, 2}), true, true},
      {"b1_n5_d3_h2_rank_above_dim_negative_beta", 1, 5, 0, 3, 2, 4, masked(Mask::none()), true,
       true, -0.9},
      {"unbatched_n6_d3_h1_causal", 1, 6, 0, 3, 1, 2, masked(Mask::causal()), true, true, 1.2,
       false},
  };
}

/// An input for emflow::attend with the cloud, queries and visibility of a case.
AttentionInput<double> layer_input(const Tensor<double>& cloud, const Tensor<double>& queries,
                                   double beta, const Visibility& v) {
  AttentionInput<double> in;
  in.cloud = cloud.data();
  in.batch = cloud.rank() == 3 ? cloud.extent(0) : 1;
  in.tokens = cloud.extent(cloud.rank() - 2);
  in.dim = cloud.extent(cloud.rank() - 1);
  in.beta = beta;
  in.mask = v.mask;
  in.key_lengths = v.key_lengths.empty() ? nullptr : v.key_lengths.data();
  if (!reference::absent(queries)) {
    in.queries = queries.data();
    in.query_tokens = queries.extent(queries.rank() - 2);
  }
  in.query_lengths = v.query_lengths.empty() ? nullptr : v.query_lengths.data();
  in.key_position = v.key_position;
  in.query_position = v.query_position;
  in.query_positions = v.query_positions.empty() ? nullptr : v.query_positions.data();
  return in;
}

struct Forward {
  Tensor<double> update, lse, entropy;
};

/// Outputs of (B, Nq, d) and (B, H, Nq), poisoned with NaN.
Forward poisoned(const Shape& update, std::int64_t B, std::int64_t H, std::int64_t Nq) {
  std::int64_t n = 1;
  for (std::int64_t e : update) n *= e;
  return {Tensor<double>(update, std::vector<double>(n, kNaN)),
          Tensor<double>({B, H, Nq}, std::vector<double>(B * H * Nq, kNaN)),
          Tensor<double>({B, H, Nq}, std::vector<double>(B * H * Nq, kNaN))};
}

struct LayerProblem {
  LayerCase c;
  Tensor<double> X, Q;  // Q absent for self-attention
  reference::FactoredLayer factored;
  reference::Layer dense;

  explicit LayerProblem(const LayerCase& lc, std::uint64_t seed = 3) : c(lc) {
    const Shape cloud = c.batched ? Shape{c.batch, c.tokens, c.dim} : Shape{c.tokens, c.dim};
    X = random_tensor(cloud, seed * 17 + 1);
    if (c.query_tokens > 0) {
      Q = random_tensor(
          c.batched ? Shape{c.batch, c.query_tokens, c.dim} : Shape{c.query_tokens, c.dim},
          seed * 17 + 2);
    }
    const double s = 1.5 / std::sqrt(static_cast<double>(c.dim));
    const std::int64_t H = c.heads, r = c.rank, d = c.dim;
    factored.query_factor = random_tensor({H, r, d}, seed * 17 + 3, -s, s);
    factored.key_factor = random_tensor({H, r, d}, seed * 17 + 4, -s, s);
    factored.content_up = random_tensor({H, d, r}, seed * 17 + 5, -s, s);
    factored.content_down = random_tensor({H, r, d}, seed * 17 + 6, -s, s);
    if (c.key_bias) factored.key_bias = random_tensor({H, d}, seed * 17 + 7);
    if (c.offset) factored.offset = random_tensor({d}, seed * 17 + 8);
    dense = random_layer(H, d, seed, c.key_bias, c.offset);
    if (!c.batched) {  // one head given without the head axis
      dense.relevance = dense.relevance.reshaped({d, d});
      dense.content = dense.content.reshaped({d, d});
      if (c.key_bias) dense.key_bias = dense.key_bias.reshaped({d});
    }
  }

  std::int64_t queries() const { return c.query_tokens > 0 ? c.query_tokens : c.tokens; }
  Shape update_shape() const {
    return c.batched ? Shape{c.batch, queries(), c.dim} : Shape{queries(), c.dim};
  }

  Forward dense_forward() const {
    Forward out = poisoned(update_shape(), c.batch, c.heads, queries());
    AttentionInput<double> in = layer_input(X, Q, c.beta, c.visibility);
    in.layer = dense.operators();
    attend(in, {out.update.data(), out.lse.data(), out.entropy.data(), nullptr},
           {Device::reference});
    return out;
  }
  Forward factored_forward() const {
    Forward out = poisoned(update_shape(), c.batch, c.heads, queries());
    attend_factored(layer_input(X, Q, c.beta, c.visibility), factored.operators(),
                    {out.update.data(), out.lse.data(), out.entropy.data(), nullptr},
                    {Device::reference});
    return out;
  }
  double loss(const OutputGradients& up, const Forward& f) const {
    return loss_of(up, f.update, f.lse, f.entropy);
  }
  OutputGradients upstream(Through through, const Forward& f, std::uint64_t seed = 9) const {
    return random_upstream(through, update_shape(), f.lse, seed);
  }
};

class LayerBackward : public ::testing::TestWithParam<std::tuple<LayerCase, Through>> {};

TEST_P(LayerBackward, DenseGradientsMatchCentralDifferences) {
  const auto& [c, through] = GetParam();
  LayerProblem p(c);
  const OutputGradients up = p.upstream(through, p.dense_forward());
  const reference::LayerGradients g =
      reference::attend_backward(p.X, p.Q, p.dense, c.beta, c.visibility, up);
  auto loss = [&] { return p.loss(up, p.dense_forward()); };
  const double h = 1e-3;

  ASSERT_GT(testing::max_abs(g.cloud), 1e-3) << "a vacuous comparison";
  EXPECT_TRUE(matches_differences(g.cloud, numeric_gradient(p.X, loss, h))) << "dX";
  if (c.query_tokens > 0) {
    EXPECT_TRUE(matches_differences(g.queries, numeric_gradient(p.Q, loss, h))) << "dQ";
  } else {
    EXPECT_TRUE(reference::absent(g.queries));
  }
  EXPECT_TRUE(matches_differences(g.relevance, numeric_gradient(p.dense.relevance, loss, h)))
      << "dM";
  EXPECT_TRUE(matches_differences(g.content, numeric_gradient(p.dense.content, loss, h))) << "dF";
  if (c.key_bias) {
    EXPECT_TRUE(matches_differences(g.key_bias, numeric_gradient(p.dense.key_bias, loss, h)))
        << "du";
  }
  if (c.offset) {
    EXPECT_TRUE(matches_differences(g.offset, numeric_gradient(p.dense.offset, loss, h))) << "dc";
  }
  EXPECT_TRUE(matches_difference(g.beta, numeric_derivative(p.c.beta, loss, h))) << "dbeta";
}

TEST_P(LayerBackward, FactoredGradientsMatchCentralDifferences) {
  const auto& [c, through] = GetParam();
  LayerProblem p(c);
  const OutputGradients up = p.upstream(through, p.factored_forward());
  const reference::FactoredGradients g =
      reference::attend_factored_backward(p.X, p.Q, p.factored, c.beta, c.visibility, up);
  auto loss = [&] { return p.loss(up, p.factored_forward()); };
  const double h = 1e-3;

  ASSERT_GT(testing::max_abs(g.cloud), 1e-3) << "a vacuous comparison";
  EXPECT_TRUE(matches_differences(g.cloud, numeric_gradient(p.X, loss, h))) << "dX";
  if (c.query_tokens > 0) {
    EXPECT_TRUE(matches_differences(g.queries, numeric_gradient(p.Q, loss, h))) << "dQ";
  }
  reference::FactoredLayer& f = p.factored;
  EXPECT_TRUE(matches_differences(g.query_factor, numeric_gradient(f.query_factor, loss, h)))
      << "dA";
  EXPECT_TRUE(matches_differences(g.key_factor, numeric_gradient(f.key_factor, loss, h))) << "dB";
  EXPECT_TRUE(matches_differences(g.content_up, numeric_gradient(f.content_up, loss, h))) << "dU";
  EXPECT_TRUE(matches_differences(g.content_down, numeric_gradient(f.content_down, loss, h)))
      << "dV";
  if (c.key_bias) {
    EXPECT_TRUE(matches_differences(g.key_bias, numeric_gradient(f.key_bias, loss, h))) << "du";
  }
  if (c.offset) {
    EXPECT_TRUE(matches_differences(g.offset, numeric_gradient(f.offset, loss, h))) << "dc";
  }
  EXPECT_TRUE(matches_difference(g.beta, numeric_derivative(p.c.beta, loss, h))) << "dbeta";
}

/// The dense form's gradients are the factored ones mapped through M = A^T B, F = U V
/// (docs/MATH.md §8.5): dA = B dM^T, dB = A dM, dU = dF V^T, dV = U^T dF; dX, dQ, du, dc and
/// dbeta are the same.
TEST_P(LayerBackward, DenseGradientsAreTheFactoredOnesThroughTheProducts) {
  const auto& [c, through] = GetParam();
  LayerProblem p(c);
  const std::int64_t H = c.heads, r = c.rank, d = c.dim;
  const reference::FactoredLayer& f = p.factored;
  reference::Layer dense;
  dense.relevance = Tensor<double>({H, d, d});
  dense.content = Tensor<double>({H, d, d});
  dense.key_bias = f.key_bias;
  dense.offset = f.offset;
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t a = 0; a < d; ++a) {
      for (std::int64_t k = 0; k < d; ++k) {
        double m = 0.0, content = 0.0;
        for (std::int64_t q = 0; q < r; ++q) {
          m += f.query_factor[(h * r + q) * d + a] * f.key_factor[(h * r + q) * d + k];
          content += f.content_up[(h * d + a) * r + q] * f.content_down[(h * r + q) * d + k];
        }
        dense.relevance[(h * d + a) * d + k] = m;
        dense.content[(h * d + a) * d + k] = content;
      }
    }
  }
  const OutputGradients up = p.upstream(through, p.factored_forward());
  const reference::FactoredGradients fg =
      reference::attend_factored_backward(p.X, p.Q, f, c.beta, c.visibility, up);
  const reference::LayerGradients dg =
      reference::attend_backward(p.X, p.Q, dense, c.beta, c.visibility, up);

  Tensor<double> dA({H, r, d}), dB({H, r, d}), dU({H, d, r}), dV({H, r, d});
  for (std::int64_t h = 0; h < H; ++h) {
    const double* dM = dg.relevance.data() + h * d * d;
    const double* dF = dg.content.data() + h * d * d;
    for (std::int64_t q = 0; q < r; ++q) {
      for (std::int64_t a = 0; a < d; ++a) {
        double da = 0.0, db = 0.0, dv = 0.0, du = 0.0;
        for (std::int64_t k = 0; k < d; ++k) {
          da += f.key_factor[(h * r + q) * d + k] * dM[a * d + k];    // (B dM^T)_qa
          db += f.query_factor[(h * r + q) * d + k] * dM[k * d + a];  // (A dM)_qa
          dv += f.content_up[(h * d + k) * r + q] * dF[k * d + a];    // (U^T dF)_qa
          du += dF[a * d + k] * f.content_down[(h * r + q) * d + k];  // (dF V^T)_aq
        }
        dA[(h * r + q) * d + a] = da;
        dB[(h * r + q) * d + a] = db;
        dV[(h * r + q) * d + a] = dv;
        dU[(h * d + a) * r + q] = du;
      }
    }
  }
  ASSERT_GT(testing::max_abs(fg.query_factor), 1e-3) << "a vacuous comparison";
  EXPECT_TRUE(tensors_near(fg.query_factor, dA, 1e-12)) << "dA";
  EXPECT_TRUE(tensors_near(fg.key_factor, dB, 1e-12)) << "dB";
  EXPECT_TRUE(tensors_near(fg.content_up, dU, 1e-12)) << "dU";
  EXPECT_TRUE(tensors_near(fg.content_down, dV, 1e-12)) << "dV";
  EXPECT_TRUE(tensors_near(fg.cloud, dg.cloud, 1e-12)) << "dX";
  if (c.query_tokens > 0) {
    EXPECT_TRUE(tensors_near(fg.queries, dg.queries, 1e-12)) << "dQ";
  }
  if (c.key_bias) {
    EXPECT_TRUE(tensors_near(fg.key_bias, dg.key_bias, 1e-12)) << "du";
  }
  if (c.offset) {
    EXPECT_TRUE(tensors_near(fg.offset, dg.offset, 1e-12)) << "dc";
  }
  EXPECT_NEAR(fg.beta, dg.beta, 1e-12 * std::max(1.0, std::abs(dg.beta))) << "dbeta";
}

INSTANTIATE_TEST_SUITE_P(Cases, LayerBackward,
                         ::testing::Combine(::testing::ValuesIn(layer_cases()),
                                            ::testing::Values(Through::update, Through::lse,
                                                              Through::entropy, Through::all)),
                         [](const ::testing::TestParamInfo<std::tuple<LayerCase, Through>>& info) {
                           return std::get<0>(info.param).name + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// The SDPA-shaped forward is the inner part of the factored form (docs/MATH.md §8.1)

class SdpaIsTheFactoredForm : public ::testing::TestWithParam<LayerCase> {};

TEST_P(SdpaIsTheFactoredForm, UpdateLseAndEntropyEqualTheFactoredReference) {
  const LayerCase& c = GetParam();
  const LayerProblem p(c);
  const reference::FactoredLayer& f = p.factored;
  const std::int64_t B = c.batch, H = c.heads, r = c.rank, d = c.dim, N = c.tokens,
                     Nq = p.queries();
  const bool bias = c.key_bias;
  const std::int64_t rs = bias ? r + 1 : r;
  // Q = A x (and a coordinate 1), K = B x (and u^T x), V = V x; scale beta.
  const Tensor<double>& Xq = c.query_tokens > 0 ? p.Q : p.X;
  Tensor<double> Q({B, H, Nq, rs}), K({B, H, N, rs}), V({B, H, N, r});
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < std::max(N, Nq); ++i) {
        for (std::int64_t q = 0; q < r; ++q) {
          double qa = 0.0, kb = 0.0, vv = 0.0;
          for (std::int64_t k = 0; k < d; ++k) {
            if (i < Nq) qa += f.query_factor[(h * r + q) * d + k] * Xq[(b * Nq + i) * d + k];
            if (i < N) {
              kb += f.key_factor[(h * r + q) * d + k] * p.X[(b * N + i) * d + k];
              vv += f.content_down[(h * r + q) * d + k] * p.X[(b * N + i) * d + k];
            }
          }
          if (i < Nq) Q[((b * H + h) * Nq + i) * rs + q] = qa;
          if (i < N) {
            K[((b * H + h) * N + i) * rs + q] = kb;
            V[((b * H + h) * N + i) * r + q] = vv;
          }
        }
        if (!bias) continue;
        if (i < Nq) Q[((b * H + h) * Nq + i) * rs + r] = 1.0;
        if (i < N) {
          double w = 0.0;
          for (std::int64_t k = 0; k < d; ++k)
            w += f.key_bias[h * d + k] * p.X[(b * N + i) * d + k];
          K[((b * H + h) * N + i) * rs + r] = w;
        }
      }
    }
  }
  Visibility v = c.visibility;
  if (c.query_tokens == 0 && v.query_lengths.empty()) v.query_lengths = v.key_lengths;
  const reference::SdpaAttention s = reference::sdpa_attend(Q, K, V, c.beta, v);

  // delta_i = sum_h U_h o^h_i + c for a query that sees a key, else 0.
  Tensor<double> update(p.update_shape());
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < Nq; ++i) {
      if (s.lse[b * H * Nq + i] == -kInf) continue;
      for (std::int64_t a = 0; a < d; ++a) {
        double delta = c.offset ? f.offset[a] : 0.0;
        for (std::int64_t h = 0; h < H; ++h) {
          for (std::int64_t q = 0; q < r; ++q) {
            delta += f.content_up[(h * d + a) * r + q] * s.output[((b * H + h) * Nq + i) * r + q];
          }
        }
        update[(b * Nq + i) * d + a] = delta;
      }
    }
  }
  const Forward expected = p.factored_forward();
  ASSERT_GT(testing::max_abs(expected.update), 1e-3) << "a vacuous comparison";
  EXPECT_TRUE(tensors_near(update, expected.update, 1e-12));
  EXPECT_TRUE(tensors_near(s.lse, expected.lse, 1e-12));
  EXPECT_TRUE(tensors_near(s.entropy, expected.entropy, 1e-12));
}

INSTANTIATE_TEST_SUITE_P(Cases, SdpaIsTheFactoredForm, ::testing::ValuesIn(layer_cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------------------------
// The edges (docs/MATH.md §8.6)

/// Rows of `t` (the last axis) that hold a non-finite value.
std::vector<std::int64_t> non_finite_rows(const Tensor<double>& t) {
  const std::int64_t width = t.extent(t.rank() - 1);
  std::vector<std::int64_t> rows;
  for (std::int64_t row = 0; row < t.size() / width; ++row) {
    for (std::int64_t a = 0; a < width; ++a) {
      if (!std::isfinite(t[row * width + a])) {
        rows.push_back(row);
        break;
      }
    }
  }
  return rows;
}

/// Every element of row `row` (the last axis) is exactly 0.
bool zero_row(const Tensor<double>& t, std::int64_t row) {
  const std::int64_t width = t.extent(t.rank() - 1);
  for (std::int64_t a = 0; a < width; ++a) {
    if (t[row * width + a] != 0.0) return false;
  }
  return true;
}

// Queries that see no key (padding, an empty cloud, a query before every key) get exact zeros;
// padding keys get exact zeros; NaN in their rows and in their upstream gradients reaches nothing.
TEST(SdpaBackwardEdges, QueriesWithoutKeysAndPaddingGetExactZeros) {
  // Cloud 0: query 0 sits before every key (positions); cloud 1: key length 3 of 5, query
  // lengths 2 of 3; cloud 2: an empty cloud.
  const SdpaCase c{
      "edges", 3, 4,
      2,       3, 5,
      2,       2, Visibility{Mask::causal(), {5, 3, 0}, {3, 2, 3}, 4, kAlignToEnd, {3, 6, 0}}};
  SdpaProblem p(c);
  const reference::SdpaAttention clean = p.forward();
  const OutputGradients up = p.upstream(Through::all);  // NaN on the rows without keys
  // NaN in the query rows that see no key and in the padding keys and values.
  const std::int64_t H = c.query_heads, Hkv = c.kv_heads, Nq = c.queries, Nk = c.keys;
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < Nq; ++i) {
        if (clean.lse[(b * H + h) * Nq + i] != -kInf) continue;
        for (std::int64_t a = 0; a < c.rank; ++a) p.Q[((b * H + h) * Nq + i) * c.rank + a] = kNaN;
      }
    }
    for (std::int64_t g = 0; g < Hkv; ++g) {
      for (std::int64_t j = c.visibility.key_lengths[b]; j < Nk; ++j) {
        for (std::int64_t a = 0; a < c.rank; ++a) p.K[((b * Hkv + g) * Nk + j) * c.rank + a] = kNaN;
        for (std::int64_t a = 0; a < c.value_rank; ++a)
          p.V[((b * Hkv + g) * Nk + j) * c.value_rank + a] = kNaN;
      }
    }
  }
  const reference::SdpaAttention f = p.forward();
  const reference::SdpaGradients g = p.backward(up);
  EXPECT_TRUE(non_finite_rows(f.output).empty());
  EXPECT_TRUE(non_finite_rows(g.queries).empty());
  EXPECT_TRUE(non_finite_rows(g.keys).empty());
  EXPECT_TRUE(non_finite_rows(g.values).empty());
  EXPECT_TRUE(non_finite_rows(g.scores).empty());
  ASSERT_GT(testing::max_abs(g.queries), 1e-3) << "a vacuous comparison";

  std::int64_t without_keys = 0;
  for (std::int64_t row = 0; row < c.batch * H * Nq; ++row) {
    if (f.lse[row] != -kInf) continue;
    ++without_keys;
    EXPECT_TRUE(zero_row(g.queries, row)) << "query row " << row;
    EXPECT_TRUE(zero_row(g.scores, row)) << "score row " << row;
  }
  EXPECT_EQ(without_keys, H * (1 + 1 + 3)) << "cloud 0 query 0, cloud 1 query 2, cloud 2";
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t g_ = 0; g_ < Hkv; ++g_) {
      for (std::int64_t j = c.visibility.key_lengths[b]; j < Nk; ++j) {
        EXPECT_TRUE(zero_row(g.keys, (b * Hkv + g_) * Nk + j)) << "padding key";
        EXPECT_TRUE(zero_row(g.values, (b * Hkv + g_) * Nk + j)) << "padding value";
      }
    }
  }
}

// The NaN rule of §8.6 on a window of width 2 (query i sees keys i - 1 and i), one head.
struct NanCase {
  std::string name;
  Through through;
  char where;                            // 'q', 'k', 'v' or 'o' (the upstream dO) at row 2
  std::vector<std::int64_t> dQ, dK, dV;  // the rows expected non-finite
};

std::ostream& operator<<(std::ostream& out, const NanCase& c) { return out << c.name; }

class SdpaBackwardNaN : public ::testing::TestWithParam<NanCase> {};

TEST_P(SdpaBackwardNaN, ReachesWhatTheRuleSays) {
  const NanCase& n = GetParam();
  const SdpaCase c{"window", 1, 1, 1, 5, 5, 2, 2, masked(Mask::sliding_window(2))};
  SdpaProblem p(c);
  OutputGradients up = p.upstream(n.through);
  switch (n.where) {
    case 'q':
      p.Q[2 * c.rank] = kNaN;
      break;
    case 'k':
      p.K[2 * c.rank] = kNaN;
      break;
    case 'v':
      p.V[2 * c.value_rank] = kNaN;
      break;
    default:
      up.update[2 * c.value_rank] = kNaN;
  }
  const reference::SdpaGradients g = p.backward(up);
  EXPECT_EQ(non_finite_rows(g.queries), n.dQ) << "dQ";
  EXPECT_EQ(non_finite_rows(g.keys), n.dK) << "dK";
  EXPECT_EQ(non_finite_rows(g.values), n.dV) << "dV";
}

INSTANTIATE_TEST_SUITE_P(
    Rule, SdpaBackwardNaN,
    ::testing::Values(
        // A NaN score (query 2, or key 2 which queries 2 and 3 see): the rows' weights are NaN.
        NanCase{"query_through_update", Through::update, 'q', {2}, {1, 2}, {1, 2}},
        NanCase{"query_through_lse", Through::lse, 'q', {2}, {1, 2}, {}},
        NanCase{"key_through_update", Through::update, 'k', {2, 3}, {1, 2, 3}, {1, 2, 3}},
        NanCase{"key_through_entropy", Through::entropy, 'k', {2, 3}, {1, 2, 3}, {}},
        // A NaN value reaches the rows that see it through D_i and dP_ij, never dV.
        NanCase{"value_through_update", Through::update, 'v', {2, 3}, {1, 2, 3}, {}},
        NanCase{"value_through_lse", Through::lse, 'v', {}, {}, {}},
        NanCase{"value_through_all", Through::all, 'v', {2, 3}, {1, 2, 3}, {}},
        // A NaN upstream gradient of query 2 reaches its row and the keys it sees.
        NanCase{"upstream_update", Through::update, 'o', {2}, {1, 2}, {1, 2}}),
    [](const ::testing::TestParamInfo<NanCase>& info) { return info.param.name; });

// The layers read no padding token and no row that takes no part: NaN there reaches nothing,
// and those rows' gradients are exact zeros.
TEST(LayerBackwardEdges, PaddingTokensAreNotReadAndGetExactZeros) {
  for (const bool factored : {false, true}) {
    SCOPED_TRACE(factored ? "factored" : "dense");
    const LayerCase c{"padding", 3,   5, 0, 3, 2, 2, with_lengths(Mask::causal(), {5, 3, 0}, {}),
                      true,      true};
    LayerProblem p(c);
    const Forward clean = factored ? p.factored_forward() : p.dense_forward();
    const OutputGradients up = p.upstream(Through::all, clean);
    for (std::int64_t b = 0; b < c.batch; ++b) {
      for (std::int64_t j = c.visibility.key_lengths[b]; j < c.tokens; ++j) {
        for (std::int64_t a = 0; a < c.dim; ++a) p.X[(b * c.tokens + j) * c.dim + a] = kNaN;
      }
    }
    std::vector<Tensor<double>> gradients;
    Tensor<double> dX;
    if (factored) {
      const reference::FactoredGradients g =
          reference::attend_factored_backward(p.X, p.Q, p.factored, c.beta, c.visibility, up);
      gradients = {g.cloud,        g.query_factor, g.key_factor, g.content_up,
                   g.content_down, g.key_bias,     g.offset,     Tensor<double>({1}, {g.beta})};
      dX = g.cloud;
    } else {
      const reference::LayerGradients g =
          reference::attend_backward(p.X, p.Q, p.dense, c.beta, c.visibility, up);
      gradients = {g.cloud,    g.relevance, g.content,
                   g.key_bias, g.offset,    Tensor<double>({1}, {g.beta})};
      dX = g.cloud;
    }
    for (const Tensor<double>& t : gradients) EXPECT_TRUE(non_finite_rows(t).empty());
    ASSERT_GT(testing::max_abs(dX), 1e-3) << "a vacuous comparison";
    for (std::int64_t b = 0; b < c.batch; ++b) {
      for (std::int64_t j = 0; j < c.tokens; ++j) {
        const bool padding = j >= c.visibility.key_lengths[b];
        EXPECT_EQ(zero_row(dX, b * c.tokens + j), padding) << "cloud " << b << " token " << j;
      }
    }
  }
}

// A real query that sees no key (it sits before every key) has an exactly zero gradient, and the
// keys no query sees too.
TEST(LayerBackwardEdges, QueriesBeforeEveryKeyGetExactZeros) {
  for (const bool factored : {false, true}) {
    SCOPED_TRACE(factored ? "factored" : "dense");
    // Keys at positions 5..10; cloud 0's queries at 4, 5, 6 (query 0 sees nothing, keys 2..5 are
    // seen by no query), cloud 1's at 12, 13, 14 (every key seen).
    const LayerCase c{"before", 2,   6, 3, 3, 2, 2, at_positions(Mask::causal(), 5, {4, 12}),
                      true,     true};
    LayerProblem p(c);
    const Forward clean = factored ? p.factored_forward() : p.dense_forward();
    const OutputGradients up = p.upstream(Through::all, clean);
    for (std::int64_t a = 0; a < c.dim; ++a) p.Q[a] = kNaN;  // never read
    for (std::int64_t j = 2; j < 6; ++j) {
      for (std::int64_t a = 0; a < c.dim; ++a) p.X[j * c.dim + a] = kNaN;  // never read
    }
    Tensor<double> dQ, dX;
    if (factored) {
      const reference::FactoredGradients g =
          reference::attend_factored_backward(p.X, p.Q, p.factored, c.beta, c.visibility, up);
      dQ = g.queries;
      dX = g.cloud;
      EXPECT_TRUE(non_finite_rows(g.query_factor).empty());
      EXPECT_TRUE(non_finite_rows(g.content_up).empty());
      EXPECT_TRUE(non_finite_rows(g.key_bias).empty());
    } else {
      const reference::LayerGradients g =
          reference::attend_backward(p.X, p.Q, p.dense, c.beta, c.visibility, up);
      dQ = g.queries;
      dX = g.cloud;
      EXPECT_TRUE(non_finite_rows(g.relevance).empty());
      EXPECT_TRUE(non_finite_rows(g.content).empty());
      EXPECT_TRUE(non_finite_rows(g.key_bias).empty());
    }
    EXPECT_TRUE(non_finite_rows(dQ).empty());
    EXPECT_TRUE(non_finite_rows(dX).empty());
    EXPECT_TRUE(zero_row(dQ, 0));
    EXPECT_FALSE(zero_row(dQ, 1));
    for (std::int64_t j = 0; j < 6; ++j) EXPECT_EQ(zero_row(dX, j), j >= 2) << "token " << j;
    for (std::int64_t j = 6; j < 12; ++j) EXPECT_FALSE(zero_row(dX, j)) << "token " << j;
  }
}

// The comparison is not blind: a gradient off by 1e-5 in one element fails it.
TEST(BackwardComparison, RejectsASlightlyWrongGradient) {
  SdpaProblem p(sdpa_cases()[1]);
  const OutputGradients up = p.upstream(Through::all);
  reference::SdpaGradients g = p.backward(up);
  const Tensor<double> numeric = numeric_gradient(
      p.K, [&] { return p.loss(up); }, 1e-3);
  ASSERT_TRUE(matches_differences(g.keys, numeric));
  g.keys[3] += 1e-5;
  EXPECT_FALSE(matches_differences(g.keys, numeric));
}

// ---------------------------------------------------------------------------------------------
// Arguments

TEST(BackwardArguments, EveryBadArgumentIsNamed) {
  using testing::rejects;
  const SdpaProblem p(sdpa_cases()[0]);  // Q (2, 6, 5, 3), K (2, 2, 5, 3), V (2, 2, 5, 2)
  const Tensor<double> Q5 = random_tensor({2, 5, 5, 3}, 1);
  EXPECT_TRUE(rejects([&] { reference::sdpa_attend(Q5, p.K, p.V, 1.0); }, "queries",
                      {"5 heads", "multiple", "(2)"}));
  EXPECT_TRUE(rejects(
      [&] {
        reference::sdpa_attend(p.Q, p.K, random_tensor({2, 2, 4, 2}, 2), 1.0);
      },
      "values", {"(2, 2, 4, 2)", "(2, 2, 5, 2)"}));
  EXPECT_TRUE(rejects(
      [&] {
        reference::sdpa_attend(p.Q, random_tensor({2, 5, 3}, 3), p.V, 1.0);
      },
      "keys", {"(B, Hkv, Nk, r)"}));
  EXPECT_TRUE(rejects([&] { reference::sdpa_attend(p.Q, p.K, p.V, kInf); }, "scale"));
  EXPECT_TRUE(rejects(
      [&] {
        reference::sdpa_attend(p.Q, p.K, p.V, 1.0, with_lengths(Mask::none(), {5, 6}, {}));
      },
      "key_lengths", {"entry 1", "[0, 5]", "6"}));
  EXPECT_TRUE(rejects(
      [&] { reference::sdpa_attend(p.Q, p.K, p.V, 1.0, with_lengths(Mask::none(), {}, {1})); },
      "query_lengths", {"1 entries", "expected 2"}));
  EXPECT_TRUE(rejects(
      [&] {
        reference::sdpa_attend(p.Q, p.K, p.V, 1.0,
                               at_positions(Mask::causal(), 0, {0, kAlignToEnd}));
      },
      "query_positions", {"entry 1", "kAlignToEnd"}));
  EXPECT_TRUE(
      rejects([&] { reference::sdpa_attend(p.Q, p.K, p.V, 1.0, masked(Mask::sliding_window(0))); },
              "mask", {"window"}));
  OutputGradients up;
  up.lse = Tensor<double>({2, 6, 4});
  EXPECT_TRUE(rejects([&] { reference::sdpa_backward(p.Q, p.K, p.V, 1.0, {}, up); }, "upstream.lse",
                      {"(2, 6, 4)", "(2, 6, 5)"}));

  const LayerProblem l(layer_cases()[5]);  // cross-attention, X (2, 6, 3), Q (2, 3, 3)
  EXPECT_TRUE(rejects(
      [&] {
        reference::attend_backward(l.X, random_tensor({2, 3, 4}, 4), l.dense, 1.0, {}, {});
      },
      "queries", {"(2, 3, 4)"}));
  OutputGradients wrong_update;
  wrong_update.update = Tensor<double>({2, 6, 3});  // the cloud's shape, not the queries'
  EXPECT_TRUE(rejects([&] { reference::attend_backward(l.X, l.Q, l.dense, 1.0, {}, wrong_update); },
                      "upstream.update", {"(2, 3, 3)"}));
  reference::FactoredLayer bad = l.factored;
  bad.content_up = Tensor<double>({2, 2, 3});
  EXPECT_TRUE(rejects([&] { reference::attend_factored_backward(l.X, l.Q, bad, 1.0, {}, {}); },
                      "content_up", {"(2, 2, 3)", "(2, 3, 2)"}));
  EXPECT_TRUE(rejects(
      [&] { reference::attend_factored_backward(l.X, l.Q, l.factored, std::nan(""), {}, {}); },
      "beta"));
}

}  // namespace
}  // namespace emflow
