// The factored form (M_h = A_h^T B_h, F_h = U_h V_h) against the dense reference of the same
// layer, on the CPU (float32, rank-r engine) and on the reference device; argument checks.
#include "emflow/factored.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/error.hpp"

namespace emflow {
namespace {

using testing::all_finite_or_neg_inf;
using testing::relative_error;
using testing::uniform;

/// A random factored layer and its dense expansion, both exact in float.
struct FactoredProblem {
  std::int64_t batch, tokens, dim, heads, rank;
  std::vector<double> cloud, A, B, U, V, bias, shift, M, F;
  std::vector<std::int64_t> key_lengths;
  Mask mask;
  double beta = 1.0;

  FactoredProblem(std::int64_t b, std::int64_t n, std::int64_t d, std::int64_t h, std::int64_t r,
                  std::uint64_t seed)
      : batch(b), tokens(n), dim(d), heads(h), rank(r) {
    const auto count = [](std::int64_t x) { return static_cast<std::size_t>(x); };
    const double s = 1.5 / std::sqrt(static_cast<double>(d));
    cloud = uniform(count(b * n * d), seed);
    A = uniform(count(h * r * d), seed + 1, -s, s);
    B = uniform(count(h * r * d), seed + 2, -s, s);
    U = uniform(count(h * d * r), seed + 3, -s, s);
    V = uniform(count(h * r * d), seed + 4, -s, s);
    bias = uniform(count(h * d), seed + 5);
    shift = uniform(count(d), seed + 6);
    M.assign(count(h * d * d), 0.0);
    F.assign(M.size(), 0.0);
    for (std::int64_t k = 0; k < h; ++k) {
      for (std::int64_t a = 0; a < d; ++a) {
        for (std::int64_t c = 0; c < d; ++c) {
          for (std::int64_t q = 0; q < r; ++q) {
            M[count((k * d + a) * d + c)] +=
                A[count((k * r + q) * d + a)] * B[count((k * r + q) * d + c)];
            F[count((k * d + a) * d + c)] +=
                U[count((k * d + a) * r + q)] * V[count((k * r + q) * d + c)];
          }
        }
      }
    }
  }
};

/// Dense reference outputs of the expanded layer, in double.
struct Expected {
  std::vector<double> update, lse, entropy;
};

Expected dense_reference(const FactoredProblem& p, bool bias, bool offset) {
  Expected e;
  e.update.resize(static_cast<std::size_t>(p.batch * p.tokens * p.dim));
  e.lse.resize(static_cast<std::size_t>(p.batch * p.heads * p.tokens));
  e.entropy.resize(e.lse.size());
  AttentionInput<double> in;
  in.cloud = p.cloud.data();
  in.batch = p.batch;
  in.tokens = p.tokens;
  in.dim = p.dim;
  in.layer = {p.heads, p.M.data(), p.F.data(), bias ? p.bias.data() : nullptr,
              offset ? p.shift.data() : nullptr};
  in.beta = p.beta;
  in.mask = p.mask;
  in.key_lengths = p.key_lengths.empty() ? nullptr : p.key_lengths.data();
  attend(in, AttentionOutput<double>{e.update.data(), e.lse.data(), e.entropy.data()},
         {Device::reference});
  return e;
}

template <class T>
struct FactoredRun {
  std::vector<T> cloud, A, B, U, V, bias, shift, update, lse, entropy;
  AttentionInput<T> input;
  FactoredLayer<T> layer;
  AttentionOutput<T> output;

  FactoredRun(const FactoredProblem& p, bool with_bias, bool with_offset)
      : cloud(p.cloud.begin(), p.cloud.end()),
        A(p.A.begin(), p.A.end()),
        B(p.B.begin(), p.B.end()),
        U(p.U.begin(), p.U.end()),
        V(p.V.begin(), p.V.end()),
        bias(p.bias.begin(), p.bias.end()),
        shift(p.shift.begin(), p.shift.end()) {
    const T nan = std::numeric_limits<T>::quiet_NaN();
    update.assign(static_cast<std::size_t>(p.batch * p.tokens * p.dim), nan);
    lse.assign(static_cast<std::size_t>(p.batch * p.heads * p.tokens), nan);
    entropy.assign(lse.size(), nan);
    input.cloud = cloud.data();
    input.batch = p.batch;
    input.tokens = p.tokens;
    input.dim = p.dim;
    input.layer = {};
    input.layer.heads = 1;
    input.beta = p.beta;
    input.mask = p.mask;
    input.key_lengths = p.key_lengths.empty() ? nullptr : p.key_lengths.data();
    layer = {p.heads,
             p.rank,
             A.data(),
             B.data(),
             U.data(),
             V.data(),
             with_bias ? bias.data() : nullptr,
             with_offset ? shift.data() : nullptr};
    output = {update.data(), lse.data(), entropy.data(), nullptr};
  }
};

struct Case {
  std::int64_t batch, tokens, dim, heads, rank;
  Mask mask;
  bool bias, offset, lengths;
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << "B=" << c.batch << " N=" << c.tokens << " d=" << c.dim << " H=" << c.heads
            << " r=" << c.rank << " mask=" << to_string(c.mask) << " bias=" << c.bias
            << " offset=" << c.offset << " lengths=" << c.lengths;
}

class FactoredMatchesDense : public ::testing::TestWithParam<Case> {};

TEST_P(FactoredMatchesDense, OnCpuAndReference) {
  const Case c = GetParam();
  FactoredProblem p(c.batch, c.tokens, c.dim, c.heads, c.rank, 40 + c.tokens + c.rank);
  p.mask = c.mask;
  p.beta = 1.25;
  if (c.lengths) {
    for (std::int64_t b = 0; b < c.batch; ++b) p.key_lengths.push_back(b == 1 ? 0 : c.tokens - b);
  }
  const Expected e = dense_reference(p, c.bias, c.offset);

  FactoredRun<float> cpu(p, c.bias, c.offset);
  attend_factored(cpu.input, cpu.layer, cpu.output, {Device::cpu, 2});
  ASSERT_TRUE(all_finite_or_neg_inf(cpu.update));
  ASSERT_TRUE(all_finite_or_neg_inf(cpu.lse));
  EXPECT_LT(relative_error(cpu.update, e.update), 1e-5);
  EXPECT_LT(relative_error(cpu.lse, e.lse), 1e-5);
  EXPECT_LT(relative_error(cpu.entropy, e.entropy), 1e-5);

  FactoredRun<float> reference(p, c.bias, c.offset);
  attend_factored(reference.input, reference.layer, reference.output, {Device::reference});
  EXPECT_LT(relative_error(reference.update, e.update), 1e-6);

  FactoredRun<double> exact(p, c.bias, c.offset);
  attend_factored(exact.input, exact.layer, exact.output, {Device::cpu});
  EXPECT_LT(relative_error(exact.update, e.update), 1e-12);
  EXPECT_LT(relative_error(exact.lse, e.lse), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FactoredMatchesDense,
    ::testing::Values(Case{1, 1, 3, 1, 1, Mask::none(), false, false, false},
                      Case{1, 7, 16, 2, 4, Mask::causal(), true, true, false},
                      Case{2, 101, 64, 3, 8, Mask::none(), true, false, true},
                      Case{3, 130, 48, 2, 16, Mask::sliding_window(20), false, true, true},
                      Case{1, 300, 128, 2, 32, Mask::causal(), true, true, false},
                      Case{1, 64, 5, 1, 7, Mask::none(), true, true, false}));

TEST(Factored, RejectsBadArgumentsNamingThem) {
  FactoredProblem p(1, 5, 4, 2, 2, 3);
  auto expect_error = [&](auto mutate, const std::string& name) {
    FactoredRun<float> run(p, true, false);
    mutate(run);
    try {
      attend_factored(run.input, run.layer, run.output, {Device::cpu});
      ADD_FAILURE() << "expected an error naming '" << name << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'" + name + "'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("attend_factored"), std::string::npos) << e.what();
    }
  };
  expect_error([](FactoredRun<float>& r) { r.layer.rank = 0; }, "rank");
  expect_error([](FactoredRun<float>& r) { r.layer.heads = 0; }, "heads");
  expect_error([](FactoredRun<float>& r) { r.layer.query_factor = nullptr; }, "query_factor");
  expect_error([](FactoredRun<float>& r) { r.layer.key_factor = nullptr; }, "key_factor");
  expect_error([](FactoredRun<float>& r) { r.layer.content_up = nullptr; }, "content_up");
  expect_error([](FactoredRun<float>& r) { r.layer.content_down = nullptr; }, "content_down");
  expect_error([](FactoredRun<float>& r) { r.input.tokens = 0; }, "tokens");
  expect_error([](FactoredRun<float>& r) { r.output.update = nullptr; }, "update");
  expect_error([](FactoredRun<float>& r) { r.input.layer.relevance = r.A.data(); }, "input.layer");
  // Outputs must not share memory with the factors or the cloud (they are read while written).
  expect_error([](FactoredRun<float>& r) { r.output.update = r.U.data(); }, "update");
  expect_error([](FactoredRun<float>& r) { r.output.lse = r.cloud.data() + 1; }, "lse");
}

}  // namespace
}  // namespace emflow
