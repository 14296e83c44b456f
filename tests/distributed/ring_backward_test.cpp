// The backward pass of attention over the job's ranks (sequence_parallel.hpp:
// distributed::attend_backward and attend_factored_backward) against emflow::attend_backward and
// attend_factored_backward over the whole batch in one process: every mask, both shard layouts,
// ragged key lengths with NaN in the padding (never read), a key bias and an offset, float and
// double, every gradient (the shard's dX, the operators', dc and dbeta, the same on every rank).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "comm.hpp"
#include "common/testing.hpp"
#include "emflow/backward.hpp"
#include "emflow/sequence_parallel.hpp"

namespace emflow::testing {
namespace {

using distributed::Layout;

struct Case {
  Mask mask;
  Layout layout;
  bool ragged;
};

std::string case_name(const Case& c) {
  return name_part(to_string(c.mask)) + (c.ragged ? "_ragged" : "") +
         (c.layout == Layout::zigzag ? "_zigzag" : "_contiguous");
}

constexpr std::int64_t kBatch = 3, kTokens = 19, kDim = 4, kHeads = 2, kRank = 3;

template <class T>
std::vector<T> values_of(std::int64_t count, std::uint64_t seed) {
  const std::vector<double> u = uniform(static_cast<std::size_t>(count), seed);
  return std::vector<T>(u.begin(), u.end());
}

// A batch whose padding tokens (beyond the lengths) hold NaN, and its upstream gradients (NaN on
// the padding rows too): neither may reach a gradient.
template <class T>
struct Batch {
  std::vector<T> cloud, dDelta;
  std::vector<T> dlse, dH;
  std::vector<std::int64_t> lengths;
  AttentionInput<T> input;

  explicit Batch(const Case& c) {
    cloud = values_of<T>(kBatch * kTokens * kDim, 11);
    dDelta = values_of<T>(kBatch * kTokens * kDim, 12);
    dlse = values_of<T>(kBatch * kHeads * kTokens, 13);
    dH = values_of<T>(kBatch * kHeads * kTokens, 14);
    if (c.ragged) {
      lengths = {kTokens, 0, 7};
      const T nan = std::numeric_limits<T>::quiet_NaN();
      for (std::int64_t b = 0; b < kBatch; ++b) {
        for (std::int64_t t = lengths[static_cast<std::size_t>(b)]; t < kTokens; ++t) {
          for (std::int64_t a = 0; a < kDim; ++a) {
            cloud[static_cast<std::size_t>((b * kTokens + t) * kDim + a)] = nan;
            dDelta[static_cast<std::size_t>((b * kTokens + t) * kDim + a)] = nan;
          }
          for (std::int64_t h = 0; h < kHeads; ++h) {
            dlse[static_cast<std::size_t>((b * kHeads + h) * kTokens + t)] = nan;
            dH[static_cast<std::size_t>((b * kHeads + h) * kTokens + t)] = nan;
          }
        }
      }
    }
    input.cloud = cloud.data();
    input.batch = kBatch;
    input.tokens = kTokens;
    input.dim = kDim;
    input.beta = 0.9;
    input.mask = c.mask;
    input.key_lengths = c.ragged ? lengths.data() : nullptr;
  }

  UpstreamGradients<T> upstream() const { return {dDelta.data(), dlse.data(), dH.data()}; }

  // This rank's shard of the input, and of the upstream gradients.
  struct Shard {
    std::vector<T> cloud, dDelta, dlse, dH;
    distributed::ShardInput<T> input;
    UpstreamGradients<T> upstream() const { return {dDelta.data(), dlse.data(), dH.data()}; }
  };
  Shard shard(const Case& c) const {
    const auto segments = distributed::shard(c.layout, kTokens, comm().size(), comm().rank());
    Shard s;
    s.cloud = distributed::gather_shard(cloud.data(), kBatch, kTokens, kDim, segments);
    s.dDelta = distributed::gather_shard(dDelta.data(), kBatch, kTokens, kDim, segments);
    s.dlse = distributed::gather_shard(dlse.data(), kBatch * kHeads, kTokens, 1, segments);
    s.dH = distributed::gather_shard(dH.data(), kBatch * kHeads, kTokens, 1, segments);
    static_cast<AttentionInput<T>&>(s.input) = input;
    s.input.cloud = s.cloud.data();
    s.input.layout = c.layout;
    return s;
  }
};

template <class T>
std::vector<T> my_rows(const std::vector<T>& whole, const Case& c) {
  const auto segments = distributed::shard(c.layout, kTokens, comm().size(), comm().rank());
  return distributed::gather_shard(whole.data(), kBatch, kTokens, kDim, segments);
}

template <class T>
double tolerance() {
  return sizeof(T) == 4 ? 2e-5 : 1e-11;
}

template <class T>
void expect_dense_equals_one_process(const Case& c) {
  Batch<T> batch(c);
  const std::vector<T> M = values_of<T>(kHeads * kDim * kDim, 21),
                       F = values_of<T>(kHeads * kDim * kDim, 22),
                       u = values_of<T>(kHeads * kDim, 23), offset = values_of<T>(kDim, 24);
  batch.input.layer = {kHeads, M.data(), F.data(), u.data(), offset.data()};
  struct Gradients {
    std::vector<T> dX, dM, dF, du, dc;
    double dbeta = 0.0;
    LayerGradientOutput<T> out() {
      return {dX.data(), nullptr, dM.data(), dF.data(), du.data(), dc.data(), &dbeta};
    }
  };
  const auto poisoned = [](std::int64_t n) {
    return std::vector<T>(static_cast<std::size_t>(n), T(-7));
  };
  Gradients whole{poisoned(kBatch * kTokens * kDim), poisoned(M.size()), poisoned(F.size()),
                  poisoned(u.size()), poisoned(kDim)};
  attend_backward(batch.input, batch.upstream(), whole.out(), ExecutionOptions{Device::cpu, 1});
  ASSERT_GT(max_abs_difference(whole.dM, std::vector<T>(whole.dM.size())), 1e-3);

  const auto shard = batch.shard(c);
  Gradients ring{poisoned(static_cast<std::int64_t>(shard.cloud.size())), poisoned(M.size()),
                 poisoned(F.size()), poisoned(u.size()), poisoned(kDim)};
  distributed::attend_backward(comm(), shard.input, shard.upstream(), ring.out(),
                               ExecutionOptions{Device::cpu, 1});
  const double tol = tolerance<T>();
  EXPECT_TRUE(close_to(ring.dX, my_rows(whole.dX, c), tol)) << "dX";
  EXPECT_TRUE(close_to(ring.dM, whole.dM, tol)) << "dM";
  EXPECT_TRUE(close_to(ring.dF, whole.dF, tol)) << "dF";
  EXPECT_TRUE(close_to(ring.du, whole.du, tol)) << "du";
  EXPECT_TRUE(close_to(ring.dc, whole.dc, tol)) << "dc";
  EXPECT_NEAR(ring.dbeta, whole.dbeta, tol * std::max(1.0, std::abs(whole.dbeta))) << "dbeta";
}

template <class T>
void expect_factored_equals_one_process(const Case& c) {
  Batch<T> batch(c);
  const std::vector<T> A = values_of<T>(kHeads * kRank * kDim, 31),
                       B = values_of<T>(kHeads * kRank * kDim, 32),
                       U = values_of<T>(kHeads * kDim * kRank, 33),
                       V = values_of<T>(kHeads * kRank * kDim, 34),
                       u = values_of<T>(kHeads * kDim, 35), offset = values_of<T>(kDim, 36);
  const FactoredLayer<T> layer{kHeads,   kRank,    A.data(), B.data(),
                               U.data(), V.data(), u.data(), offset.data()};
  struct Gradients {
    std::vector<T> dX, dA, dB, dU, dV, du, dc;
    double dbeta = 0.0;
    FactoredGradientOutput<T> out() {
      return {dX.data(), nullptr,   dA.data(), dB.data(), dU.data(),
              dV.data(), du.data(), dc.data(), &dbeta};
    }
  };
  const auto poisoned = [](std::size_t n) { return std::vector<T>(n, T(-7)); };
  Gradients whole{poisoned(batch.cloud.size()), poisoned(A.size()), poisoned(B.size()),
                  poisoned(U.size()),           poisoned(V.size()), poisoned(u.size()),
                  poisoned(offset.size())};
  attend_factored_backward(batch.input, layer, batch.upstream(), whole.out(),
                           ExecutionOptions{Device::cpu, 1});
  ASSERT_GT(max_abs_difference(whole.dA, std::vector<T>(whole.dA.size())), 1e-3);

  const auto shard = batch.shard(c);
  Gradients ring{poisoned(shard.cloud.size()), poisoned(A.size()), poisoned(B.size()),
                 poisoned(U.size()),           poisoned(V.size()), poisoned(u.size()),
                 poisoned(offset.size())};
  distributed::attend_factored_backward(comm(), shard.input, layer, shard.upstream(), ring.out(),
                                        ExecutionOptions{Device::cpu, 1});
  const double tol = tolerance<T>();
  EXPECT_TRUE(close_to(ring.dX, my_rows(whole.dX, c), tol)) << "dX";
  EXPECT_TRUE(close_to(ring.dA, whole.dA, tol)) << "dA";
  EXPECT_TRUE(close_to(ring.dB, whole.dB, tol)) << "dB";
  EXPECT_TRUE(close_to(ring.dU, whole.dU, tol)) << "dU";
  EXPECT_TRUE(close_to(ring.dV, whole.dV, tol)) << "dV";
  EXPECT_TRUE(close_to(ring.du, whole.du, tol)) << "du";
  EXPECT_TRUE(close_to(ring.dc, whole.dc, tol)) << "dc";
  EXPECT_NEAR(ring.dbeta, whole.dbeta, tol * std::max(1.0, std::abs(whole.dbeta))) << "dbeta";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const Mask mask : {Mask::none(), Mask::causal(), Mask::sliding_window(3)}) {
    for (const Layout layout : {Layout::contiguous, Layout::zigzag}) {
      out.push_back({mask, layout, false});
      out.push_back({mask, layout, true});
    }
  }
  return out;
}

class RingBackward : public ::testing::TestWithParam<Case> {};

TEST_P(RingBackward, DenseFloatEqualsOneProcess) {
  expect_dense_equals_one_process<float>(GetParam());
}
TEST_P(RingBackward, DenseDoubleEqualsOneProcess) {
  expect_dense_equals_one_process<double>(GetParam());
}
TEST_P(RingBackward, FactoredFloatEqualsOneProcess) {
  expect_factored_equals_one_process<float>(GetParam());
}
TEST_P(RingBackward, FactoredDoubleEqualsOneProcess) {
  expect_factored_equals_one_process<double>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Masks, RingBackward, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return case_name(info.param); });

TEST(RingBackwardErrors, RotaryLayersAndQueryGradientsAreRefusedByName) {
  const Case c{Mask::causal(), Layout::contiguous, false};
  Batch<float> batch(c);
  const auto shard = batch.shard(c);
  const std::vector<float> f(kHeads * kRank * kDim, 0.25f);
  FactoredLayer<float> layer{kHeads, kRank, f.data(), f.data(), f.data(), f.data()};
  layer.rotary.dim = 2;
  std::vector<float> dX(shard.cloud.size()), dQ(shard.cloud.size());
  EXPECT_TRUE(throws_error(
      [&] {
        distributed::attend_factored_backward(comm(), shard.input, layer, shard.upstream(),
                                              {dX.data()});
      },
      ErrorCode::unsupported, {"rotary.dim"}));
  layer.rotary.dim = 0;
  FactoredGradientOutput<float> with_queries{dX.data()};
  with_queries.queries = dQ.data();
  EXPECT_TRUE(throws_error(
      [&] {
        distributed::attend_factored_backward(comm(), shard.input, layer, shard.upstream(),
                                              with_queries);
      },
      ErrorCode::invalid_argument, {"'queries'", "defaults"}));
}

}  // namespace
}  // namespace emflow::testing
