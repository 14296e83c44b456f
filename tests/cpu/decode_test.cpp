// emflow::DecodeCache: decoding a cloud token by token (append x_t, attend x_t) gives the rows of
// the causal one-pass update, and so do blocks of several new tokens, under the window mask too;
// a long cache (whose keys the engine splits across threads) matches the reference; an empty
// cache gives 0, -inf, 0; non-finite tokens are refused.
#include "emflow/decode.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"

namespace emflow {
namespace {

using testing::close_to;

struct Layer {
  std::int64_t heads, dim;
  std::vector<float> relevance, content, bias, offset;
  Layer(std::int64_t h, std::int64_t d) : heads(h), dim(d) {
    const double scale = 2.0 / std::sqrt(static_cast<double>(d));
    const auto make = [](const std::vector<double>& v) {
      return std::vector<float>(v.begin(), v.end());
    };
    relevance = make(testing::uniform(h * d * d, 21, -scale, scale));
    content = make(testing::uniform(h * d * d, 22, -scale, scale));
    bias = make(testing::uniform(h * d, 23));
    offset = make(testing::uniform(d, 24));
  }
  LayerOperators<float> operators() const {
    return {heads, relevance.data(), content.data(), bias.data(), offset.data()};
  }
};

struct OnePass {
  std::vector<float> update, lse, entropy;
};

OnePass one_pass(const Layer& layer, const std::vector<float>& cloud, std::int64_t tokens,
                 const Mask& mask, double beta) {
  OnePass out{std::vector<float>(cloud.size()),
              std::vector<float>(static_cast<std::size_t>(layer.heads * tokens)),
              std::vector<float>(static_cast<std::size_t>(layer.heads * tokens))};
  AttentionInput<float> in;
  in.cloud = cloud.data();
  in.tokens = tokens;
  in.dim = layer.dim;
  in.layer = layer.operators();
  in.mask = mask;
  in.beta = beta;
  attend(in, {out.update.data(), out.lse.data(), out.entropy.data(), nullptr}, {Device::cpu, 2});
  return out;
}

/// Decodes `cloud` in blocks of `step` tokens and returns the rows as the one pass lays them out.
OnePass decode(const Layer& layer, const std::vector<float>& cloud, std::int64_t tokens,
               std::int64_t step, const Mask& mask, double beta) {
  const std::int64_t d = layer.dim, H = layer.heads;
  DecodeCache cache(layer.operators(), d, beta);
  OnePass out{std::vector<float>(cloud.size(), NAN),
              std::vector<float>(static_cast<std::size_t>(H * tokens), NAN),
              std::vector<float>(static_cast<std::size_t>(H * tokens), NAN)};
  for (std::int64_t t = 0; t < tokens; t += step) {
    const std::int64_t n = std::min(step, tokens - t);
    cache.append(cloud.data() + t * d, n);
    EXPECT_EQ(cache.size(), t + n);
    std::vector<float> lse(static_cast<std::size_t>(H * n), NAN), entropy(lse.size(), NAN);
    cache.attend(cloud.data() + t * d, n, mask,
                 {out.update.data() + t * d, lse.data(), entropy.data(), nullptr});
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < n; ++i) {
        out.lse[static_cast<std::size_t>(h * tokens + t + i)] = lse[h * n + i];
        out.entropy[static_cast<std::size_t>(h * tokens + t + i)] = entropy[h * n + i];
      }
    }
  }
  return out;
}

void expect_same(const OnePass& got, const OnePass& want) {
  EXPECT_TRUE(close_to(got.update, want.update, 2e-5));
  EXPECT_TRUE(close_to(got.lse, want.lse, 2e-5));
  EXPECT_TRUE(close_to(got.entropy, want.entropy, 2e-5));
}

TEST(DecodeCache, TokenByTokenEqualsTheCausalOnePass) {
  const Layer layer(2, 16);
  const std::int64_t N = 300;
  const std::vector<double> values = testing::uniform(N * 16, 5);
  const std::vector<float> cloud(values.begin(), values.end());
  expect_same(decode(layer, cloud, N, 1, Mask::causal(), 0.8),
              one_pass(layer, cloud, N, Mask::causal(), 0.8));
}

TEST(DecodeCache, BlocksOfTokensUnderCausalAndWindowMasks) {
  const Layer layer(3, 7);
  const std::int64_t N = 200;
  const std::vector<double> values = testing::uniform(N * 7, 6);
  const std::vector<float> cloud(values.begin(), values.end());
  for (const Mask& mask : {Mask::causal(), Mask::sliding_window(5), Mask::sliding_window(64)}) {
    for (std::int64_t step : {3, 7, 64}) {
      SCOPED_TRACE(to_string(mask) + " step " + std::to_string(step));
      expect_same(decode(layer, cloud, N, step, mask, 1.0), one_pass(layer, cloud, N, mask, 1.0));
    }
  }
}

// A long cache: the engine splits its keys into spans; the queries match the reference.
TEST(DecodeCache, LongCacheMatchesTheReference) {
  const Layer layer(2, 8);
  const std::int64_t N = 9000, Nq = 5;
  const std::vector<double> values = testing::uniform(N * 8, 7);
  const std::vector<float> cloud(values.begin(), values.end());
  DecodeCache cache(layer.operators(), 8);
  cache.append(cloud.data(), N - 1000);
  for (std::int64_t t = N - 1000; t < N; t += 250) cache.append(cloud.data() + t * 8, 250);
  const float* queries = cloud.data() + (N - Nq) * 8;
  for (const Mask& mask : {Mask::causal(), Mask::none(), Mask::sliding_window(3000)}) {
    std::vector<float> update(Nq * 8, NAN), lse(2 * Nq, NAN), entropy(2 * Nq, NAN);
    cache.attend(queries, Nq, mask, {update.data(), lse.data(), entropy.data(), nullptr}, N - Nq,
                 2);
    AttentionInput<float> in;
    in.cloud = cloud.data();
    in.tokens = N;
    in.dim = 8;
    in.layer = layer.operators();
    in.mask = mask;
    in.queries = queries;
    in.query_tokens = Nq;
    std::vector<float> want(Nq * 8), want_lse(2 * Nq), want_entropy(2 * Nq);
    attend(in, {want.data(), want_lse.data(), want_entropy.data(), nullptr}, {Device::reference});
    EXPECT_TRUE(close_to(update, want, 1e-5)) << to_string(mask);
    EXPECT_TRUE(close_to(lse, want_lse, 1e-5)) << to_string(mask);
    EXPECT_TRUE(close_to(entropy, want_entropy, 1e-5)) << to_string(mask);
  }
}

TEST(DecodeCache, EmptyCacheAndQueriesBeforeEveryKey) {
  const Layer layer(1, 4);
  DecodeCache cache(layer.operators(), 4);
  const std::vector<float> x{0.5f, -0.25f, 1.0f, 0.0f};
  std::vector<float> update(4, NAN), lse(1, NAN), entropy(1, NAN);
  cache.attend(x.data(), 1, Mask::causal(), {update.data(), lse.data(), entropy.data(), nullptr});
  EXPECT_EQ(update, std::vector<float>(4, 0.0f));
  EXPECT_EQ(lse[0], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(entropy[0], 0.0f);
  cache.append(x.data(), 1);
  // A query at position -1 sees no key under the causal mask; at 0 it sees key 0 alone.
  cache.attend(x.data(), 1, Mask::causal(), {update.data(), lse.data(), entropy.data(), nullptr},
               -1);
  EXPECT_EQ(update, std::vector<float>(4, 0.0f));
  EXPECT_EQ(lse[0], -std::numeric_limits<float>::infinity());
  cache.attend(x.data(), 1, Mask::causal(), {update.data(), lse.data(), entropy.data(), nullptr});
  EXPECT_TRUE(std::isfinite(lse[0]));
  EXPECT_EQ(entropy[0], 0.0f);  // one key: weight 1
  EXPECT_NE(update, std::vector<float>(4, 0.0f));
}

TEST(DecodeCache, RefusesNonFiniteTokensAndBadArguments) {
  const Layer layer(1, 4);
  DecodeCache cache(layer.operators(), 4);
  std::vector<float> x(8, 0.5f);
  x[6] = NAN;
  EXPECT_TRUE(testing::throws_error([&] { cache.append(x.data(), 2); }, ErrorCode::invalid_argument,
                                    {"'tokens'", "row 1"}));
  EXPECT_EQ(cache.size(), 0);
  std::vector<float> update(4);
  EXPECT_TRUE(testing::throws_error(
      [&] {
        cache.attend(x.data(), 1, Mask::causal(), {update.data(), nullptr, nullptr, x.data()});
      },
      ErrorCode::invalid_argument, {"'weights'"}));
  EXPECT_TRUE(testing::throws_error(
      [&] {
        cache.attend(x.data(), 1, Mask::causal(), {x.data() + 2, nullptr, nullptr, nullptr});
      },
      ErrorCode::invalid_argument, {"'update'", "queries"}));
  LayerOperators<float> empty;
  EXPECT_TRUE(testing::throws_error([&] { DecodeCache bad(empty, 4); }, ErrorCode::invalid_argument,
                                    {"'relevance'"}));
}

}  // namespace
}  // namespace emflow
