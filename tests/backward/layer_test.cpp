// The backward pass of the dense and factored layers (include/emflow/backward.hpp) on every host
// target (targets.hpp) against the double reference (reference::attend_backward,
// reference::attend_factored_backward), through each upstream gradient alone and all of them:
// self- and cross-attention, every mask, key and query lengths with padding and an empty cloud,
// positions, key bias and offset, rank below and above d; exact zeros on the rows that take no
// part (padding holding NaN, queries without keys with NaN upstream gradients); the bitwise
// independence of the thread count; the refusals, by name.
//
// Bounds: as for the SDPA-shaped operator (sdpa_test.cpp), 1e-5 relative for float over each
// gradient array and 1e-12 for double. The chain rule adds products of d or r terms in float32
// (about 1e-7 sqrt(d) each) to the SDPA-shaped gradients' error; measured, the largest float
// error is about 1e-6. Scalars (dbeta) are held to the bound times the size of their terms.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backward/targets.hpp"
#include "common/testing.hpp"
#include "emflow/backward.hpp"
#include "emflow/reference.hpp"

namespace emflow {
namespace {

using reference::Visibility;
using testing::HostTarget;
using testing::Through;

struct LayerCase {
  std::string name;
  std::int64_t batch, tokens, query_tokens;  // query_tokens 0: self-attention
  std::int64_t dim, heads, rank;
  Visibility visibility;
  bool key_bias = true, offset = true;
  double beta = 0.9;

  bool self() const { return query_tokens == 0; }
  std::int64_t queries() const { return self() ? tokens : query_tokens; }
};

std::ostream& operator<<(std::ostream& out, const LayerCase& c) { return out << c.name; }

Visibility masked(Mask mask) {
  Visibility v;
  v.mask = mask;
  return v;
}

std::vector<LayerCase> layer_cases() {
  Visibility lengths = masked(Mask::causal());
  lengths.key_lengths = {70, 31, 0};
  Visibility cross_positions = masked(Mask::causal());
  cross_positions.key_position = 5;
  cross_positions.query_positions = {-3, 40};
  Visibility cross_lengths = masked(Mask::sliding_window(12));
  cross_lengths.key_lengths = {90, 33};
  cross_lengths.query_lengths = {21, 7};
  return {
      {"self_none_d12_r5", 2, 70, 0, 12, 2, 5, masked(Mask::none())},
      {"self_causal_d9_r11", 1, 100, 0, 9, 3, 11, masked(Mask::causal()), true, false, -0.6},
      {"self_window_d16_r8_no_bias", 1, 90, 0, 16, 2, 8, masked(Mask::sliding_window(9)), false,
       true},
      {"self_causal_lengths_empty", 3, 70, 0, 7, 2, 3, lengths},
      {"cross_causal_positions", 2, 80, 25, 10, 2, 4, cross_positions},
      {"cross_window_lengths", 2, 90, 21, 8, 3, 6, cross_lengths, true, true, 1.4},
      {"self_d64_r16_blocks", 1, 200, 0, 64, 2, 16, masked(Mask::causal()), true, true, 0.2},
  };
}

/// A case's arrays (float-exact), NaN in the padding tokens (which no target may read).
struct Problem {
  Tensor<double> X, Q;  // Q absent for self-attention
  reference::Layer dense;
  reference::FactoredLayer factored;

  Problem(const LayerCase& c, std::uint64_t seed) {
    const std::int64_t B = c.batch, N = c.tokens, d = c.dim, H = c.heads, r = c.rank;
    X = testing::float_exact(testing::random_tensor({B, N, d}, seed * 13 + 1));
    if (!c.self()) {
      Q = testing::float_exact(testing::random_tensor({B, c.query_tokens, d}, seed * 13 + 2));
    }
    const double s = 1.5 / std::sqrt(static_cast<double>(d));
    dense.relevance = testing::float_exact(testing::random_tensor({H, d, d}, seed * 13 + 3, -s, s));
    dense.content = testing::float_exact(testing::random_tensor({H, d, d}, seed * 13 + 4, -s, s));
    const double t = 1.2 / std::sqrt(std::sqrt(static_cast<double>(d * r)));
    factored.query_factor =
        testing::float_exact(testing::random_tensor({H, r, d}, seed * 13 + 5, -t, t));
    factored.key_factor =
        testing::float_exact(testing::random_tensor({H, r, d}, seed * 13 + 6, -t, t));
    factored.content_up =
        testing::float_exact(testing::random_tensor({H, d, r}, seed * 13 + 7, -t, t));
    factored.content_down =
        testing::float_exact(testing::random_tensor({H, r, d}, seed * 13 + 8, -t, t));
    if (c.key_bias) {
      dense.key_bias = testing::float_exact(testing::random_tensor({H, d}, seed * 13 + 9, -s, s));
      factored.key_bias = dense.key_bias;
    }
    if (c.offset) {
      dense.offset = testing::float_exact(testing::random_tensor({d}, seed * 13 + 10));
      factored.offset = dense.offset;
    }
    const Visibility& v = c.visibility;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t Lk = v.key_lengths.empty() ? N : v.key_lengths[b];
      for (std::int64_t j = Lk; j < N; ++j) {
        for (std::int64_t a = 0; a < d; ++a) X[(b * N + j) * d + a] = testing::kNaN;
      }
      if (c.self() || v.query_lengths.empty()) continue;
      for (std::int64_t i = v.query_lengths[b]; i < c.query_tokens; ++i) {
        for (std::int64_t a = 0; a < d; ++a) Q[(b * c.query_tokens + i) * d + a] = testing::kNaN;
      }
    }
  }
};

template <class T>
AttentionInput<T> input_of(const LayerCase& c, const std::vector<T>& X, const std::vector<T>& Q) {
  AttentionInput<T> in;
  in.cloud = X.data();
  in.batch = c.batch;
  in.tokens = c.tokens;
  in.dim = c.dim;
  in.beta = c.beta;
  const Visibility& v = c.visibility;
  in.mask = v.mask;
  in.key_lengths = v.key_lengths.empty() ? nullptr : v.key_lengths.data();
  if (!c.self()) {
    in.queries = Q.data();
    in.query_tokens = c.query_tokens;
  }
  in.query_lengths = v.query_lengths.empty() ? nullptr : v.query_lengths.data();
  in.key_position = v.key_position;
  in.query_position = v.query_position;
  in.query_positions = v.query_positions.empty() ? nullptr : v.query_positions.data();
  return in;
}

/// Random upstream gradients through `through`, NaN on the rows of queries without keys
/// (`sees`, per (b, h, i); the update's rows share them over the heads).
reference::OutputGradients upstream_of(Through through, const LayerCase& c,
                                       const std::vector<bool>& sees, std::uint64_t seed) {
  const std::int64_t B = c.batch, H = c.heads, Nq = c.queries();
  std::vector<bool> update_rows(static_cast<std::size_t>(B * Nq));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < Nq; ++i) {
      update_rows[static_cast<std::size_t>(b * Nq + i)] =
          sees[static_cast<std::size_t>(b * H * Nq + i)];
    }
  }
  reference::OutputGradients up;
  if (testing::with_update(through)) {
    up.update = testing::nan_rows(
        testing::float_exact(testing::random_tensor({B, Nq, c.dim}, seed * 3 + 1)), c.dim,
        update_rows);
  }
  if (testing::with_lse(through)) {
    up.lse = testing::nan_rows(
        testing::float_exact(testing::random_tensor({B, H, Nq}, seed * 3 + 2)), 1, sees);
  }
  if (testing::with_entropy(through)) {
    up.entropy = testing::nan_rows(
        testing::float_exact(testing::random_tensor({B, H, Nq}, seed * 3 + 3)), 1, sees);
  }
  return up;
}

/// Which rows of the queries (B, Nq) and of the cloud (B, N) take part (docs/MATH.md §8.6), from
/// the reference's weights: a query with a key (lse finite), a key with a positive weight.
struct Participation {
  std::vector<bool> queries, keys, stats;
};

Participation participation(const LayerCase& c, const reference::Attention& forward) {
  const std::int64_t B = c.batch, H = c.heads, N = c.tokens, Nq = c.queries();
  Participation p;
  p.stats = testing::rows_with_keys(forward.lse);
  p.queries.assign(static_cast<std::size_t>(B * Nq), false);
  p.keys.assign(static_cast<std::size_t>(B * N), false);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < Nq; ++i) {
      p.queries[static_cast<std::size_t>(b * Nq + i)] =
          p.stats[static_cast<std::size_t>(b * H * Nq + i)];
      for (std::int64_t j = 0; j < N; ++j) {
        if (forward.weights[((b * H) * Nq + i) * N + j] > 0) {
          p.keys[static_cast<std::size_t>(b * N + j)] = true;
        }
      }
    }
  }
  return p;
}

/// The reference's forward pass of the dense layer (for lse, and the weights that say which
/// rows take part), through emflow::attend on Device::reference.
reference::Attention dense_forward(const LayerCase& c, const Problem& p) {
  const std::int64_t B = c.batch, H = c.heads, N = c.tokens, Nq = c.queries(), d = c.dim;
  reference::Attention out;
  out.update = Tensor<double>({B, Nq, d});
  out.lse = Tensor<double>({B, H, Nq});
  out.entropy = Tensor<double>({B, H, Nq});
  out.weights = Tensor<double>({B, H, Nq, N});
  AttentionInput<double> in = input_of(c, p.X.values(), p.Q.values());
  in.layer = p.dense.operators();
  attend(in,
         AttentionOutput<double>{out.update.data(), out.lse.data(), out.entropy.data(),
                                 out.weights.data()},
         ExecutionOptions{Device::reference, 1});
  return out;
}

template <class T>
std::vector<T> vector_or_empty(const Tensor<double>& t) {
  return reference::absent(t) ? std::vector<T>{} : testing::as_vector<T>(t);
}

template <class T>
const T* data_or_null(const std::vector<T>& v) {
  return v.empty() ? nullptr : v.data();
}

template <class T>
T* data_or_null(std::vector<T>& v) {
  return v.empty() ? nullptr : v.data();
}

/// A gradient array poisoned with NaN, or empty when the reference has none.
template <class T>
std::vector<T> output_like(const Tensor<double>& expected) {
  return reference::absent(expected) ? std::vector<T>{} : testing::poisoned<T>(expected.size());
}

template <class T>
::testing::AssertionResult matches(const std::vector<T>& actual, const Tensor<double>& expected,
                                   double tolerance) {
  if (reference::absent(expected)) {
    if (actual.empty()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "a gradient the reference does not have";
  }
  return testing::close_to(actual, expected.values(), tolerance);
}

/// The size of the terms of dL/dbeta: sum |dS_ij s_ij| / |beta| is bounded by the norms of the
/// query rows' gradients and the rows themselves; this takes ||dX|| ||X|| / |beta| on the rows
/// that take part as the scale (generous, and still 1e5 times the error of a wrong sum).
double beta_magnitude(const Tensor<double>& dX, const Tensor<double>& X,
                      const std::vector<bool>& rows, double beta) {
  double g = 0.0, x = 0.0;
  const std::int64_t d = X.extent(2);
  for (std::size_t row = 0; row < rows.size(); ++row) {
    if (!rows[row]) continue;
    for (std::int64_t a = 0; a < d; ++a) {
      const std::int64_t e = static_cast<std::int64_t>(row) * d + a;
      g += dX[e] * dX[e];
      x += X[e] * X[e];
    }
  }
  return std::sqrt(g * x) / std::abs(beta) + 1e-300;
}

class LayerBackward : public ::testing::TestWithParam<std::tuple<HostTarget, LayerCase>> {};

TEST_P(LayerBackward, DenseGradientsMatchTheReference) {
  const HostTarget& target = std::get<0>(GetParam());
  const LayerCase& c = std::get<1>(GetParam());
  const Problem p(c, 31);
  const reference::Attention forward = dense_forward(c, p);
  const Participation part = participation(c, forward);
  testing::in_precision(target.is_double, [&](auto zero) {
    using T = decltype(zero);
    const double tol = target.tolerance();
    const std::vector<T> X = testing::as_vector<T>(p.X), Q = vector_or_empty<T>(p.Q);
    const std::vector<T> M = testing::as_vector<T>(p.dense.relevance),
                         F = testing::as_vector<T>(p.dense.content),
                         u = vector_or_empty<T>(p.dense.key_bias),
                         cv = vector_or_empty<T>(p.dense.offset);
    AttentionInput<T> in = input_of(c, X, Q);
    in.layer = {c.heads, M.data(), F.data(), data_or_null(u), data_or_null(cv)};
    for (Through through : testing::kEveryThrough) {
      SCOPED_TRACE(testing::to_string(through));
      const reference::OutputGradients up = upstream_of(through, c, part.stats, 7);
      const reference::LayerGradients expected =
          reference::attend_backward(p.X, p.Q, p.dense, c.beta, c.visibility, up);
      const std::vector<T> dD = vector_or_empty<T>(up.update), dl = vector_or_empty<T>(up.lse),
                           dh = vector_or_empty<T>(up.entropy);
      std::vector<T> dX = output_like<T>(expected.cloud), dQ = output_like<T>(expected.queries),
                     dM = output_like<T>(expected.relevance), dF = output_like<T>(expected.content),
                     du = output_like<T>(expected.key_bias), dc = output_like<T>(expected.offset);
      double dbeta = testing::kNaN;
      attend_backward(
          in, UpstreamGradients<T>{data_or_null(dD), data_or_null(dl), data_or_null(dh)},
          LayerGradientOutput<T>{data_or_null(dX), data_or_null(dQ), data_or_null(dM),
                                 data_or_null(dF), data_or_null(du), data_or_null(dc), &dbeta},
          ExecutionOptions{target.device, target.threads});
      EXPECT_TRUE(matches(dX, expected.cloud, tol)) << "dX";
      EXPECT_TRUE(matches(dQ, expected.queries, tol)) << "dQ";
      EXPECT_TRUE(matches(dM, expected.relevance, tol)) << "dM";
      EXPECT_TRUE(matches(dF, expected.content, tol)) << "dF";
      EXPECT_TRUE(matches(du, expected.key_bias, tol)) << "du";
      EXPECT_TRUE(matches(dc, expected.offset, tol)) << "dc";
      const Tensor<double>& dq = c.self() ? expected.cloud : expected.queries;
      const Tensor<double>& q = c.self() ? p.X : p.Q;
      EXPECT_TRUE(testing::scalar_close(dbeta, expected.beta,
                                        beta_magnitude(dq, q, part.queries, c.beta), tol))
          << "dbeta";
      // Rows that take no part: exact zeros whatever their tokens and upstream gradients hold.
      std::vector<bool> idle_keys(part.keys.size()), idle_queries(part.queries.size());
      for (std::size_t e = 0; e < idle_keys.size(); ++e) {
        idle_keys[e] = !part.keys[e] && (!c.self() || !part.queries[e]);
      }
      for (std::size_t e = 0; e < idle_queries.size(); ++e) idle_queries[e] = !part.queries[e];
      EXPECT_TRUE(testing::zero_rows(dX, c.dim, idle_keys)) << "dX";
      if (!c.self()) {
        EXPECT_TRUE(testing::zero_rows(dQ, c.dim, idle_queries)) << "dQ";
      }
    }
  });
}

TEST_P(LayerBackward, FactoredGradientsMatchTheReference) {
  const HostTarget& target = std::get<0>(GetParam());
  const LayerCase& c = std::get<1>(GetParam());
  const Problem p(c, 37);
  const reference::Attention forward = dense_forward(c, p);
  const Participation part = participation(c, forward);
  testing::in_precision(target.is_double, [&](auto zero) {
    using T = decltype(zero);
    const double tol = target.tolerance();
    const std::vector<T> X = testing::as_vector<T>(p.X), Q = vector_or_empty<T>(p.Q);
    const std::vector<T> A = testing::as_vector<T>(p.factored.query_factor),
                         Bf = testing::as_vector<T>(p.factored.key_factor),
                         U = testing::as_vector<T>(p.factored.content_up),
                         V = testing::as_vector<T>(p.factored.content_down),
                         u = vector_or_empty<T>(p.factored.key_bias),
                         cv = vector_or_empty<T>(p.factored.offset);
    const AttentionInput<T> in = input_of(c, X, Q);
    FactoredLayer<T> layer;
    layer.heads = c.heads;
    layer.rank = c.rank;
    layer.query_factor = A.data();
    layer.key_factor = Bf.data();
    layer.content_up = U.data();
    layer.content_down = V.data();
    layer.key_bias = data_or_null(u);
    layer.offset = data_or_null(cv);
    for (Through through : testing::kEveryThrough) {
      SCOPED_TRACE(testing::to_string(through));
      const reference::OutputGradients up = upstream_of(through, c, part.stats, 11);
      const reference::FactoredGradients expected =
          reference::attend_factored_backward(p.X, p.Q, p.factored, c.beta, c.visibility, up);
      const std::vector<T> dD = vector_or_empty<T>(up.update), dl = vector_or_empty<T>(up.lse),
                           dh = vector_or_empty<T>(up.entropy);
      std::vector<T> dX = output_like<T>(expected.cloud), dQ = output_like<T>(expected.queries),
                     dA = output_like<T>(expected.query_factor),
                     dB = output_like<T>(expected.key_factor),
                     dU = output_like<T>(expected.content_up),
                     dV = output_like<T>(expected.content_down),
                     du = output_like<T>(expected.key_bias), dc = output_like<T>(expected.offset);
      double dbeta = testing::kNaN;
      attend_factored_backward(
          in, layer, UpstreamGradients<T>{data_or_null(dD), data_or_null(dl), data_or_null(dh)},
          FactoredGradientOutput<T>{data_or_null(dX), data_or_null(dQ), data_or_null(dA),
                                    data_or_null(dB), data_or_null(dU), data_or_null(dV),
                                    data_or_null(du), data_or_null(dc), &dbeta},
          ExecutionOptions{target.device, target.threads});
      EXPECT_TRUE(matches(dX, expected.cloud, tol)) << "dX";
      EXPECT_TRUE(matches(dQ, expected.queries, tol)) << "dQ";
      EXPECT_TRUE(matches(dA, expected.query_factor, tol)) << "dA";
      EXPECT_TRUE(matches(dB, expected.key_factor, tol)) << "dB";
      EXPECT_TRUE(matches(dU, expected.content_up, tol)) << "dU";
      EXPECT_TRUE(matches(dV, expected.content_down, tol)) << "dV";
      EXPECT_TRUE(matches(du, expected.key_bias, tol)) << "du";
      EXPECT_TRUE(matches(dc, expected.offset, tol)) << "dc";
      const Tensor<double>& dq = c.self() ? expected.cloud : expected.queries;
      const Tensor<double>& q = c.self() ? p.X : p.Q;
      EXPECT_TRUE(testing::scalar_close(dbeta, expected.beta,
                                        beta_magnitude(dq, q, part.queries, c.beta), tol))
          << "dbeta";
      std::vector<bool> idle_keys(part.keys.size()), idle_queries(part.queries.size());
      for (std::size_t e = 0; e < idle_keys.size(); ++e) {
        idle_keys[e] = !part.keys[e] && (!c.self() || !part.queries[e]);
      }
      for (std::size_t e = 0; e < idle_queries.size(); ++e) idle_queries[e] = !part.queries[e];
      EXPECT_TRUE(testing::zero_rows(dX, c.dim, idle_keys)) << "dX";
      if (!c.self()) {
        EXPECT_TRUE(testing::zero_rows(dQ, c.dim, idle_queries)) << "dQ";
      }
    }
  });
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<HostTarget, LayerCase>>& info) {
  return std::get<0>(info.param).name() + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Cases, LayerBackward,
                         ::testing::Combine(::testing::ValuesIn(testing::host_targets()),
                                            ::testing::ValuesIn(layer_cases())),
                         case_name);

}  // namespace
}  // namespace emflow
