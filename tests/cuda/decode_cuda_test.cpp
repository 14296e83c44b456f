// DecodeCache on Device::cuda: decoding a cloud token by token and in blocks gives the outputs of
// the host cache (causal and window masks, outputs poisoned before every call); one query
// against keys enough for several key splits matches the reference; bad calls are refused by
// name. Without a usable device the device cases skip, saying why.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/attention.hpp"
#include "emflow/decode.hpp"

#if defined(EMFLOW_WITH_CUDA)
#include "emflow/cuda.hpp"
#endif

namespace emflow::testing {
namespace {

bool have_device(std::string* why) {
#if defined(EMFLOW_WITH_CUDA)
  return cuda::device_available(why);
#else
  *why = "emflow was built without CUDA";
  return false;
#endif
}

#define SKIP_WITHOUT_DEVICE()                                                 \
  do {                                                                        \
    std::string why;                                                          \
    if (!have_device(&why)) GTEST_SKIP() << "no usable CUDA device: " << why; \
  } while (0)

struct Layer {
  std::int64_t heads, dim;
  std::vector<float> relevance, content, bias, offset;
  Layer(std::int64_t h, std::int64_t d) : heads(h), dim(d) {
    const double s = 2.0 / std::sqrt(static_cast<double>(d));
    const auto make = [](std::size_t n, std::uint64_t seed, double lo, double hi) {
      const std::vector<double> v = uniform(n, seed, lo, hi);
      return std::vector<float>(v.begin(), v.end());
    };
    relevance = make(static_cast<std::size_t>(h * d * d), 41, -s, s);
    content = make(static_cast<std::size_t>(h * d * d), 42, -s, s);
    bias = make(static_cast<std::size_t>(h * d), 43, -1, 1);
    offset = make(static_cast<std::size_t>(d), 44, -1, 1);
  }
  LayerOperators<float> operators() const {
    return {heads, relevance.data(), content.data(), bias.data(), offset.data()};
  }
};

TEST(CudaDecode, TokenByTokenAndBlocksEqualTheHostCache) {
  SKIP_WITHOUT_DEVICE();
  const Layer layer(2, 8);
  const std::int64_t N = 10, d = 8, H = 2;
  const std::vector<double> values = uniform(N * d, 45);
  const std::vector<float> cloud(values.begin(), values.end());
  // A prompt block then single tokens under the causal mask; blocks under a window (the
  // emulated launches are slow: few calls).
  struct Case {
    Mask mask;
    std::vector<std::int64_t> steps;
  };
  for (const Case& c :
       {Case{Mask::causal(), {6, 1, 1, 1, 1}}, Case{Mask::sliding_window(3), {5, 5}}}) {
    SCOPED_TRACE(to_string(c.mask));
    DecodeCache host(layer.operators(), d, 0.9);
    DecodeCache device(layer.operators(), d, 0.9, {Device::cuda, N});
    EXPECT_EQ(device.device(), Device::cuda);
    std::int64_t t = 0;
    for (const std::int64_t n : c.steps) {
      host.append(cloud.data() + t * d, n);
      device.append(cloud.data() + t * d, n);
      std::vector<float> want(n * d, NAN), want_lse(H * n, NAN), want_entropy(H * n, NAN);
      std::vector<float> got(n * d, NAN), lse(H * n, NAN), entropy(H * n, NAN);
      host.attend(cloud.data() + t * d, n, c.mask,
                  {want.data(), want_lse.data(), want_entropy.data(), nullptr});
      device.attend(cloud.data() + t * d, n, c.mask,
                    {got.data(), lse.data(), entropy.data(), nullptr});
      EXPECT_TRUE(close_to(got, want, 1e-5)) << "token " << t;
      EXPECT_TRUE(close_to(lse, want_lse, 1e-5)) << "token " << t;
      EXPECT_TRUE(close_to(entropy, want_entropy, 1e-4)) << "token " << t;
      t += n;
    }
    EXPECT_EQ(device.size(), N);
  }
}

// 700 keys: one query's keys fall into several splits, merged on the device.
TEST(CudaDecode, OneQueryAgainstSplitKeysMatchesTheReference) {
  SKIP_WITHOUT_DEVICE();
  const Layer layer(2, 16);
  const std::int64_t N = 700, d = 16;
  const std::vector<double> values = uniform(N * d, 46);
  const std::vector<float> cloud(values.begin(), values.end());
  DecodeCache cache(layer.operators(), d, 1.0, {Device::cuda, 1024});
  cache.append(cloud.data(), 500);
  cache.append(cloud.data() + 500 * d, N - 500);
  const float* query = cloud.data() + (N - 1) * d;
  for (const Mask& mask : {Mask::none(), Mask::sliding_window(450)}) {
    std::vector<float> update(d, NAN), lse(2, NAN), entropy(2, NAN);
    cache.attend(query, 1, mask, {update.data(), lse.data(), entropy.data(), nullptr});
    AttentionInput<float> in;
    in.cloud = cloud.data();
    in.tokens = N;
    in.dim = d;
    in.layer = layer.operators();
    in.mask = mask;
    in.queries = query;
    in.query_tokens = 1;
    std::vector<float> want(d), want_lse(2), want_entropy(2);
    attend(in, {want.data(), want_lse.data(), want_entropy.data(), nullptr}, {Device::reference});
    EXPECT_TRUE(close_to(update, want, 1e-5)) << to_string(mask);
    EXPECT_TRUE(close_to(lse, want_lse, 1e-5)) << to_string(mask);
    EXPECT_TRUE(close_to(entropy, want_entropy, 1e-4)) << to_string(mask);
  }
}

TEST(CudaDecode, RefusesBadCallsByName) {
  const Layer layer(1, 4);
  EXPECT_TRUE(throws_error(
      [&] {
        DecodeCache c(layer.operators(), 4, 1.0, {Device::cuda, 0});
      },
      ErrorCode::invalid_argument, {"'capacity'"}));
  const std::vector<double> dense(16, 0.25);
  const LayerOperators<double> doubles{1, dense.data(), dense.data(), nullptr, nullptr};
  EXPECT_TRUE(throws_error(
      [&] {
        BasicDecodeCache<double> c(doubles, 4, 1.0, {Device::cuda, 8});
      },
      ErrorCode::unsupported, {"'device'"}));
  std::string why;
  if (!have_device(&why)) {
    // The reason is route()'s for Operation::decode (capability.hpp).
    EXPECT_TRUE(throws_error(
        [&] {
          DecodeCache c(layer.operators(), 4, 1.0, {Device::cuda, 8});
        },
        ErrorCode::unsupported, {"DecodeCache", "device 'cuda' requested but unavailable"}));
    GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  DecodeCache cache(layer.operators(), 4, 1.0, {Device::cuda, 3});
  const std::vector<float> x(16, 0.5f);
  cache.append(x.data(), 2);
  EXPECT_TRUE(throws_error([&] { cache.append(x.data(), 2); }, ErrorCode::invalid_argument,
                           {"'count'", "capacity of 3"}));
  EXPECT_EQ(cache.size(), 2);
}

}  // namespace
}  // namespace emflow::testing
