// emflow::DecodingStack and emflow::generate (emflow/generate.hpp) against the stack applied to
// the whole grown cloud at once: each layer an emflow::attend under the causal mask on
// Device::reference, then its norm, for post- and pre-norm stacks under every norm, layers of
// several heads with key bias, offset and norm gain and bias. Tokens moved in several calls
// continue the positions; generate() feeds each last output back; bad arguments and sizes that
// cannot fit are refused by name before any work.
#include "emflow/generate.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "emflow/memory.hpp"

namespace emflow::testing {
namespace {

constexpr std::int64_t kDim = 6;

std::vector<float> floats(std::size_t count, std::uint64_t seed, double lo = -1.0,
                          double hi = 1.0) {
  const std::vector<double> v = uniform(count, seed, lo, hi);
  return {v.begin(), v.end()};
}

// L layers of `heads` heads in R^kDim with every optional part present.
std::vector<flow::FlowLayer<float>> random_layers(std::int64_t L, std::int64_t heads,
                                                  std::uint64_t seed) {
  std::vector<flow::FlowLayer<float>> layers;
  const double s = 1.5 / std::sqrt(static_cast<double>(kDim));
  for (std::int64_t l = 0; l < L; ++l) {
    flow::FlowLayer<float> layer;
    layer.heads = heads;
    const auto square = static_cast<std::size_t>(heads * kDim * kDim);
    layer.relevance = floats(square, seed + 10 * l, -s, s);
    layer.content = floats(square, seed + 10 * l + 1, -s, s);
    layer.key_bias = floats(static_cast<std::size_t>(heads * kDim), seed + 10 * l + 2, -0.3, 0.3);
    layer.offset = floats(kDim, seed + 10 * l + 3, -0.1, 0.1);
    layer.norm_gain = floats(kDim, seed + 10 * l + 4, 0.5, 1.5);
    layer.norm_bias = floats(kDim, seed + 10 * l + 5, -0.2, 0.2);
    layers.push_back(layer);
  }
  return layers;
}

// What the stack makes of a whole cloud (n x kDim) at once: paths (n, L + 1, d) and the mean
// entropy over heads (n, L), every layer through emflow::attend on the reference.
struct WholeCloud {
  std::vector<float> paths;
  std::vector<double> entropy;
};

WholeCloud whole_cloud(std::vector<float> x, const std::vector<flow::FlowLayer<float>>& layers,
                       double beta, const DecodingSettings& s) {
  const auto n = static_cast<std::int64_t>(x.size()) / kDim;
  const auto L = static_cast<std::int64_t>(layers.size());
  WholeCloud out;
  out.paths.resize(static_cast<std::size_t>(n * (L + 1) * kDim));
  out.entropy.resize(static_cast<std::size_t>(n * L));
  const auto record = [&](std::int64_t slot) {
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t a = 0; a < kDim; ++a)
        out.paths[static_cast<std::size_t>((t * (L + 1) + slot) * kDim + a)] =
            x[static_cast<std::size_t>(t * kDim + a)];
  };
  for (std::int64_t l = 0; l < L; ++l) {
    const flow::FlowLayer<float>& layer = layers[static_cast<std::size_t>(l)];
    record(l);
    std::vector<float> attended = x;
    if (s.pre_norm) {
      flow::normalize(s.norm, attended.data(), n, kDim, layer.norm_gain.data(),
                      layer.norm_bias.data(), s.norm_eps);
    }
    std::vector<float> update(x.size()), entropy(static_cast<std::size_t>(layer.heads * n));
    AttentionInput<float> in;
    in.cloud = attended.data();
    in.tokens = n;
    in.dim = kDim;
    in.layer = layer.operators();
    in.beta = beta;
    in.mask = Mask::causal();
    AttentionOutput<float> o;
    o.update = update.data();
    o.entropy = entropy.data();
    attend(in, o, {Device::reference});
    for (std::size_t k = 0; k < x.size(); ++k) x[k] += update[k];
    if (!s.pre_norm) {
      flow::normalize(s.norm, x.data(), n, kDim, layer.norm_gain.data(), layer.norm_bias.data(),
                      s.norm_eps);
    }
    for (std::int64_t t = 0; t < n; ++t) {
      double sum = 0.0;
      for (std::int64_t h = 0; h < layer.heads; ++h)
        sum += entropy[static_cast<std::size_t>(h * n + t)];
      out.entropy[static_cast<std::size_t>(t * L + l)] = sum / static_cast<double>(layer.heads);
    }
  }
  record(L);
  return out;
}

struct StackCase {
  flow::Normalization norm;
  bool pre_norm;
};

std::string case_name(const ::testing::TestParamInfo<StackCase>& info) {
  return std::string(flow::to_string(info.param.norm)) + (info.param.pre_norm ? "_pre" : "_post");
}

class Stack : public ::testing::TestWithParam<StackCase> {};

// A prompt in two calls, then single new tokens: every output, path and entropy equals the
// rows of the whole grown cloud moved through the stack at once.
TEST_P(Stack, ForwardEqualsTheStackOnTheWholeGrownCloud) {
  const std::int64_t L = 3, heads = 2, prompt = 9, steps = 5, n = prompt + steps;
  const std::vector<flow::FlowLayer<float>> layers = random_layers(L, heads, 7);
  DecodingSettings s;
  s.norm = GetParam().norm;
  s.pre_norm = GetParam().pre_norm;
  s.norm_eps = 1e-3;
  const double beta = 1.25;
  const std::vector<float> cloud = floats(static_cast<std::size_t>(n * kDim), 3);
  const WholeCloud expected = whole_cloud(cloud, layers, beta, s);

  DecodingStack stack(layers, kDim, beta, s);
  EXPECT_EQ(stack.layers(), L);
  EXPECT_EQ(stack.size(), 0);
  std::vector<float> moved = cloud;
  std::vector<float> paths(static_cast<std::size_t>(n * (L + 1) * kDim),
                           std::numeric_limits<float>::quiet_NaN());
  std::vector<double> entropy(static_cast<std::size_t>(n * L),
                              std::numeric_limits<double>::quiet_NaN());
  const auto forward = [&](std::int64_t first, std::int64_t count) {
    stack.forward(moved.data() + first * kDim, count,
                  {paths.data() + first * (L + 1) * kDim, entropy.data() + first * L});
  };
  forward(0, 4);
  forward(4, prompt - 4);
  EXPECT_EQ(stack.size(), prompt);
  for (std::int64_t t = prompt; t < n; ++t) forward(t, 1);
  EXPECT_EQ(stack.size(), n);
  for (std::int64_t l = 0; l < L; ++l) EXPECT_EQ(stack.cache(l).size(), n);

  std::vector<float> last(static_cast<std::size_t>(n * kDim));
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t a = 0; a < kDim; ++a)
      last[static_cast<std::size_t>(t * kDim + a)] =
          expected.paths[static_cast<std::size_t>((t * (L + 1) + L) * kDim + a)];
  EXPECT_TRUE(close_to(moved, last, 2e-5));
  EXPECT_TRUE(close_to(paths, expected.paths, 2e-5));
  EXPECT_TRUE(close_to(entropy, expected.entropy, 2e-5));

  // clear() starts again at position 0: the same outputs for the same prompt.
  stack.clear();
  EXPECT_EQ(stack.size(), 0);
  std::vector<float> again(cloud.begin(), cloud.begin() + prompt * kDim);
  stack.forward(again.data(), prompt);
  EXPECT_EQ(again, std::vector<float>(moved.begin(), moved.begin() + prompt * kDim));
}

INSTANTIATE_TEST_SUITE_P(Norms, Stack,
                         ::testing::Values(StackCase{flow::Normalization::none, false},
                                           StackCase{flow::Normalization::sphere, false},
                                           StackCase{flow::Normalization::layernorm, false},
                                           StackCase{flow::Normalization::layernorm, true},
                                           StackCase{flow::Normalization::rmsnorm, true},
                                           StackCase{flow::Normalization::sphere, true}),
                         case_name);

// Two clouds at their own beta: each new token enters as the last output before it, and the
// paths and entropies are the rows of the grown cloud moved through the stack at once.
TEST(Generate, FeedsEachLastOutputBackThroughTheStack) {
  const std::int64_t B = 2, N = 7, L = 2, K = 6;
  const std::vector<flow::FlowLayer<float>> layers = random_layers(L, 3, 21);
  DecodingSettings s;
  s.norm = flow::Normalization::rmsnorm;
  const std::vector<double> betas = {0.5, 2.0};
  const Tensor<float> prompts(Shape{B, N, kDim}, floats(B * N * kDim, 22));
  const Generation g = generate(prompts, layers, betas, K, s);
  ASSERT_EQ(g.paths.shape(), (Shape{B, K, L + 1, kDim}));
  EXPECT_EQ(g.clouds, B);
  EXPECT_EQ(g.prompt_tokens, N);
  EXPECT_EQ(g.layers, L);
  EXPECT_EQ(g.steps, K);
  ASSERT_EQ(g.entropy.size(), static_cast<std::size_t>(B * K * L));
  ASSERT_EQ(g.seconds.size(), static_cast<std::size_t>(K));
  for (double t : g.seconds) EXPECT_GE(t, 0.0);

  for (std::int64_t b = 0; b < B; ++b) {
    SCOPED_TRACE("cloud " + std::to_string(b));
    const float* path = g.paths.data() + b * K * (L + 1) * kDim;
    // The grown cloud as entered: the prompt, then each new token at the input of layer 0.
    std::vector<float> grown(prompts.data() + b * N * kDim, prompts.data() + (b + 1) * N * kDim);
    for (std::int64_t t = 0; t < K; ++t)
      grown.insert(grown.end(), path + t * (L + 1) * kDim, path + t * (L + 1) * kDim + kDim);
    const WholeCloud expected = whole_cloud(grown, layers, betas[static_cast<std::size_t>(b)], s);
    const std::vector<float> paths(path, path + K * (L + 1) * kDim);
    const std::vector<float> rows(expected.paths.begin() + N * (L + 1) * kDim,
                                  expected.paths.end());
    EXPECT_TRUE(close_to(paths, rows, 2e-5));
    const std::vector<double> entropy(g.entropy.begin() + b * K * L,
                                      g.entropy.begin() + (b + 1) * K * L);
    EXPECT_TRUE(close_to(
        entropy, std::vector<double>(expected.entropy.begin() + N * L, expected.entropy.end()),
        2e-5));
    // The first new token is the prompt's last output; each later one the previous output.
    for (std::int64_t a = 0; a < kDim; ++a) {
      EXPECT_NEAR(path[a],
                  expected.paths[static_cast<std::size_t>(((N - 1) * (L + 1) + L) * kDim + a)],
                  2e-5);
      for (std::int64_t t = 1; t < K; ++t) {
        EXPECT_EQ(path[t * (L + 1) * kDim + a], path[((t - 1) * (L + 1) + L) * kDim + a]);
      }
    }
  }
}

TEST(DecodingStack, RefusesBadArgumentsByName) {
  const std::vector<flow::FlowLayer<float>> layers = random_layers(2, 2, 5);
  EXPECT_TRUE(throws_error([&] { DecodingStack({}, kDim); }, ErrorCode::invalid_argument,
                           {"DecodingStack: argument 'layers'", "at least one layer"}));
  EXPECT_TRUE(throws_error([&] { DecodingStack(layers, 0); }, ErrorCode::invalid_argument,
                           {"argument 'dim'"}));
  EXPECT_TRUE(throws_error([&] { DecodingStack(layers, kDim, std::nan("")); },
                           ErrorCode::invalid_argument, {"argument 'beta'"}));
  DecodingSettings s;
  s.norm_eps = 0.0;
  EXPECT_TRUE(throws_error([&] { DecodingStack(layers, kDim, 1.0, s); },
                           ErrorCode::invalid_argument, {"argument 'norm_eps'"}));
  s = {};
  s.threads = -1;
  EXPECT_TRUE(throws_error([&] { DecodingStack(layers, kDim, 1.0, s); },
                           ErrorCode::invalid_argument, {"argument 'threads'"}));
  std::vector<flow::FlowLayer<float>> bad = layers;
  bad[1].norm_gain.pop_back();
  EXPECT_TRUE(throws_error([&] { DecodingStack(bad, kDim); }, ErrorCode::invalid_argument,
                           {"argument 'layers' layer 1: norm_gain has 5 entries, expected 6"}));
  bad = layers;
  bad[0].content.resize(3);
  EXPECT_TRUE(throws_error([&] { DecodingStack(bad, kDim); }, ErrorCode::invalid_argument,
                           {"layer 0: content has 3 entries, expected 72"}));

  DecodingStack stack(layers, kDim);
  std::vector<float> token = floats(kDim, 1);
  EXPECT_TRUE(throws_error([&] { stack.forward(token.data(), 0); }, ErrorCode::invalid_argument,
                           {"argument 'count'"}));
  EXPECT_TRUE(throws_error([&] { stack.forward(nullptr, 1); }, ErrorCode::invalid_argument,
                           {"argument 'tokens'"}));
  EXPECT_TRUE(throws_error([&] { stack.cache(2); }, ErrorCode::invalid_argument,
                           {"argument 'layer' must be in [0, 1], got 2"}));
  token[3] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_error([&] { stack.forward(token.data(), 1); }, ErrorCode::invalid_argument));
  EXPECT_EQ(stack.size(), 0);  // refused at the first layer: nothing kept
}

TEST(Generate, RefusesBadArgumentsByName) {
  const std::vector<flow::FlowLayer<float>> layers = random_layers(1, 1, 5);
  const Tensor<float> prompts(Shape{2, 3, kDim}, floats(2 * 3 * kDim, 2));
  EXPECT_TRUE(throws_error(
      [&] {
        generate(Tensor<float>(Shape{3, kDim}), layers, {1.0}, 1);
      },
      ErrorCode::invalid_argument, {"generate: argument 'prompts'"}));
  EXPECT_TRUE(throws_error(
      [&] {
        generate(prompts, layers, {1.0, 2.0, 3.0}, 1);
      },
      ErrorCode::invalid_argument, {"argument 'betas'", "got 3"}));
  EXPECT_TRUE(throws_error([&] { generate(prompts, layers, {1.0}, -5); },
                           ErrorCode::invalid_argument, {"argument 'steps' must be >= 0, got -5"}));
  EXPECT_TRUE(throws_error([&] { generate(prompts, {}, {1.0}, 1); }, ErrorCode::invalid_argument,
                           {"argument 'layers'"}));
  EXPECT_TRUE(throws_error(
      [&] {
        generate(prompts, random_layers(1, 1, 5), {1.0}, 1, [] {
          DecodingSettings s;
          s.norm_eps = -1.0;
          return s;
        }());
      },
      ErrorCode::invalid_argument, {"argument 'norm_eps'"}));
  const Generation none = generate(prompts, layers, {1.0}, 0);
  EXPECT_EQ(none.paths.shape(), (Shape{2, 0, 2, kDim}));
}

// 10^9 steps of 255 heads: the caches alone could grow to 50 TB. Refused at once, with the bytes,
// before anything is allocated.
TEST(Generate, SizesThatCannotFitAreRefusedBeforeAnyWork) {
  std::vector<flow::FlowLayer<float>> layers = random_layers(1, 255, 9);
  const Tensor<float> prompts(Shape{1, 2, kDim}, floats(2 * kDim, 2));
  const std::int64_t steps = 1000000000;
  const std::int64_t values =
      steps * 2 * kDim + 2 * steps * 2 + 2 * (steps + 2) * (kDim + 255 * 16);
  if (memory_limit_bytes() / 4 >= values) GTEST_SKIP() << "this machine has 50 TB";
  EXPECT_TRUE(throws_error(
      [&] { generate(prompts, layers, {1.0}, steps); }, ErrorCode::out_of_memory,
      {"generate: the generation (paths", "decode caches",
       "needs " + std::to_string(values * 4) + " bytes", "bytes of memory available"}));
}

}  // namespace
}  // namespace emflow::testing
