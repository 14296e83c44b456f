// BasicDecodeCache in float and double, dense and factored: decoding a cloud token by token, and
// in blocks of several tokens, equals the one-pass causal (and window) result of emflow::attend /
// emflow::attend_factored (float 1e-6, double 1e-12 relative), the outputs poisoned before every
// call; a long cache whose keys split into spans across threads matches the reference; bad
// arguments are refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/decode.hpp"
#include "emflow/factored.hpp"

namespace emflow {
namespace {

using testing::close_to;

/// One layer in both forms' arrays (the dense one used for the dense cache, the factors for the
/// factored one), with key bias and offset.
template <class T>
struct Layer {
  std::int64_t heads, dim, rank;
  std::vector<T> relevance, content, A, B, U, V, bias, offset;
  Layer(std::int64_t h, std::int64_t d, std::int64_t r) : heads(h), dim(d), rank(r) {
    const double s = 1.5 / std::sqrt(static_cast<double>(d));
    const auto make = [](std::size_t n, std::uint64_t seed, double lo, double hi) {
      const std::vector<double> v = testing::uniform(n, seed, lo, hi);
      return std::vector<T>(v.begin(), v.end());
    };
    const auto n = static_cast<std::size_t>(h * d);
    relevance = make(n * d, 31, -s, s);
    content = make(n * d, 32, -s, s);
    A = make(n * r, 33, -s, s);
    B = make(n * r, 34, -s, s);
    U = make(n * r, 35, -s, s);
    V = make(n * r, 36, -s, s);
    bias = make(n, 37, -1, 1);
    offset = make(static_cast<std::size_t>(d), 38, -1, 1);
  }
  LayerOperators<T> dense() const {
    return {heads, relevance.data(), content.data(), bias.data(), offset.data()};
  }
  FactoredLayer<T> factored() const {
    return {heads, rank, A.data(), B.data(), U.data(), V.data(), bias.data(), offset.data()};
  }
};

template <class T>
struct Rows {
  std::vector<T> update, lse, entropy;
};

template <class T>
Rows<T> one_pass(const Layer<T>& layer, bool factored, const std::vector<T>& cloud,
                 std::int64_t tokens, const Mask& mask, double beta) {
  Rows<T> out{std::vector<T>(cloud.size(), T(NAN)),
              std::vector<T>(static_cast<std::size_t>(layer.heads * tokens), T(NAN)),
              std::vector<T>(static_cast<std::size_t>(layer.heads * tokens), T(NAN))};
  AttentionInput<T> in;
  in.cloud = cloud.data();
  in.tokens = tokens;
  in.dim = layer.dim;
  in.mask = mask;
  in.beta = beta;
  const AttentionOutput<T> o{out.update.data(), out.lse.data(), out.entropy.data(), nullptr};
  if (factored) {
    attend_factored(in, layer.factored(), o, {testing::host_device(), 2});
  } else {
    in.layer = layer.dense();
    attend(in, o, {testing::host_device(), 2});
  }
  return out;
}

template <class T>
Rows<T> decode(const Layer<T>& layer, bool factored, const std::vector<T>& cloud,
               std::int64_t tokens, std::int64_t step, const Mask& mask, double beta) {
  const std::int64_t d = layer.dim, H = layer.heads;
  BasicDecodeCache<T> cache = factored ? BasicDecodeCache<T>(layer.factored(), d, beta)
                                       : BasicDecodeCache<T>(layer.dense(), d, beta);
  EXPECT_EQ(cache.factored(), factored);
  Rows<T> out{std::vector<T>(cloud.size()), std::vector<T>(static_cast<std::size_t>(H * tokens)),
              std::vector<T>(static_cast<std::size_t>(H * tokens))};
  for (std::int64_t t = 0; t < tokens; t += step) {
    const std::int64_t n = std::min(step, tokens - t);
    cache.append(cloud.data() + t * d, n);
    EXPECT_EQ(cache.size(), t + n);
    std::vector<T> update(static_cast<std::size_t>(n * d), T(NAN));
    std::vector<T> lse(static_cast<std::size_t>(H * n), T(NAN)), entropy(lse.size(), T(NAN));
    cache.attend(cloud.data() + t * d, n, mask,
                 {update.data(), lse.data(), entropy.data(), nullptr}, kAlignToEnd, 2);
    std::copy(update.begin(), update.end(), out.update.begin() + t * d);
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < n; ++i) {
        out.lse[static_cast<std::size_t>(h * tokens + t + i)] = lse[h * n + i];
        out.entropy[static_cast<std::size_t>(h * tokens + t + i)] = entropy[h * n + i];
      }
    }
  }
  return out;
}

template <class T>
class DecodeForms : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DecodeForms, Types);

TYPED_TEST(DecodeForms, TokenByTokenAndBlocksEqualTheOnePass) {
  using T = TypeParam;
  const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-12;
  const Layer<T> layer(2, 12, 5);
  const std::int64_t N = 70;
  const std::vector<double> values = testing::uniform(N * 12, 9);
  const std::vector<T> cloud(values.begin(), values.end());
  for (bool factored : {false, true}) {
    // The dense float cache is the engine's: where no path of it runs, it is refused by name.
    if (std::is_same_v<T, float> && !factored && !this_machine().cpu_missing.empty()) {
      EXPECT_THROW(BasicDecodeCache<T>(layer.dense(), 12), Error);
      continue;
    }
    for (const Mask& mask : {Mask::causal(), Mask::sliding_window(6)}) {
      const Rows<T> want = one_pass(layer, factored, cloud, N, mask, 0.7);
      for (std::int64_t step : {1, 4, 33}) {
        SCOPED_TRACE(std::string(factored ? "factored " : "dense ") + to_string(mask) + " step " +
                     std::to_string(step));
        const Rows<T> got = decode(layer, factored, cloud, N, step, mask, 0.7);
        EXPECT_TRUE(close_to(got.update, want.update, tolerance));
        EXPECT_TRUE(close_to(got.lse, want.lse, tolerance));
        EXPECT_TRUE(close_to(got.entropy, want.entropy, tolerance));
      }
    }
  }
}

// 2500 keys: with two threads the store splits each query's keys into spans and merges them.
TYPED_TEST(DecodeForms, LongCacheSplitAcrossThreadsMatchesTheReference) {
  using T = TypeParam;
  const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-12;
  const std::int64_t N = 2500, Nq = 2, d = 6;
  const Layer<T> layer(2, d, 3);
  const std::vector<double> values = testing::uniform(N * d, 10);
  const std::vector<T> cloud(values.begin(), values.end());
  BasicDecodeCache<T> cache(layer.factored(), d);
  cache.append(cloud.data(), N - 500);
  cache.append(cloud.data() + (N - 500) * d, 500);
  for (const Mask& mask : {Mask::causal(), Mask::sliding_window(1800)}) {
    std::vector<T> update(Nq * d, T(NAN)), lse(2 * Nq, T(NAN)), entropy(2 * Nq, T(NAN));
    const T* queries = cloud.data() + (N - Nq) * d;
    cache.attend(queries, Nq, mask, {update.data(), lse.data(), entropy.data(), nullptr},
                 kAlignToEnd, 2);
    AttentionInput<T> in;
    in.cloud = cloud.data();
    in.tokens = N;
    in.dim = d;
    in.mask = mask;
    in.queries = queries;
    in.query_tokens = Nq;
    std::vector<T> want(Nq * d), want_lse(2 * Nq), want_entropy(2 * Nq);
    attend_factored(in, layer.factored(),
                    {want.data(), want_lse.data(), want_entropy.data(), nullptr},
                    {Device::reference});
    EXPECT_TRUE(close_to(update, want, tolerance)) << to_string(mask);
    EXPECT_TRUE(close_to(lse, want_lse, tolerance)) << to_string(mask);
    EXPECT_TRUE(close_to(entropy, want_entropy, tolerance)) << to_string(mask);
  }
}

TYPED_TEST(DecodeForms, EmptyCacheGivesZeroAndClearDropsTokens) {
  using T = TypeParam;
  const Layer<T> layer(1, 4, 2);
  BasicDecodeCache<T> cache(layer.factored(), 4);
  const std::vector<T> x{T(0.5), T(-0.25), T(1), T(0)};
  std::vector<T> update(4, T(NAN)), lse(1, T(NAN)), entropy(1, T(NAN));
  cache.attend(x.data(), 1, Mask::causal(), {update.data(), lse.data(), entropy.data(), nullptr});
  EXPECT_EQ(update, std::vector<T>(4, T(0)));
  EXPECT_EQ(lse[0], -std::numeric_limits<T>::infinity());
  cache.append(x.data(), 1);
  cache.attend(x.data(), 1, Mask::causal(), {update.data(), lse.data(), entropy.data(), nullptr});
  EXPECT_TRUE(std::isfinite(lse[0]));
  EXPECT_NE(update, std::vector<T>(4, T(0)));
  cache.clear();
  EXPECT_EQ(cache.size(), 0);
  cache.attend(x.data(), 1, Mask::causal(), {update.data(), lse.data(), entropy.data(), nullptr});
  EXPECT_EQ(lse[0], -std::numeric_limits<T>::infinity());
}

TYPED_TEST(DecodeForms, RefusesBadArgumentsByName) {
  using T = TypeParam;
  const Layer<T> layer(2, 4, 2);
  const auto refused = [](auto&& call, const char* name) {
    return testing::throws_error(call, ErrorCode::invalid_argument, {name});
  };
  FactoredLayer<T> f = layer.factored();
  EXPECT_TRUE(refused([&] { BasicDecodeCache<T> c(f, 0); }, "'dim'"));
  f.rank = 0;
  EXPECT_TRUE(refused([&] { BasicDecodeCache<T> c(f, 4); }, "'rank'"));
  f = layer.factored();
  f.heads = 0;
  EXPECT_TRUE(refused([&] { BasicDecodeCache<T> c(f, 4); }, "'heads'"));
  f = layer.factored();
  f.key_factor = nullptr;
  EXPECT_TRUE(refused([&] { BasicDecodeCache<T> c(f, 4); }, "'key_factor'"));
  EXPECT_TRUE(refused([&] { BasicDecodeCache<T> c(layer.factored(), 4, NAN); }, "'beta'"));
  LayerOperators<T> dense = layer.dense();
  dense.content = nullptr;
  EXPECT_TRUE(refused([&] { BasicDecodeCache<T> c(dense, 4); }, "'content'"));

  BasicDecodeCache<T> cache(layer.factored(), 4);
  std::vector<T> x(8, T(0.5));
  x[5] = T(INFINITY);
  EXPECT_TRUE(refused([&] { cache.append(x.data(), 2); }, "row 1"));
  EXPECT_EQ(cache.size(), 0);
  EXPECT_TRUE(refused([&] { cache.append(x.data(), -1); }, "'count'"));
  std::vector<T> update(4);
  EXPECT_TRUE(refused(
      [&] {
        cache.attend(x.data(), 0, Mask::causal(), {update.data(), nullptr, nullptr, nullptr});
      },
      "'count'"));
  EXPECT_TRUE(refused(
      [&] {
        cache.attend(x.data(), 1, Mask::sliding_window(0),
                     {update.data(), nullptr, nullptr, nullptr});
      },
      "'mask'"));
}

}  // namespace
}  // namespace emflow
