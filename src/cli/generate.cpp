#include "generate.hpp"

#include <chrono>
#include <cmath>
#include <memory>

#include "emflow/attention.hpp"
#include "emflow/decode.hpp"

namespace emflow::cli {

namespace {

/// Rows of `x` (count x d) to the unit sphere; a zero row stays zero.
void to_sphere(float* x, std::int64_t count, std::int64_t d) {
  for (std::int64_t i = 0; i < count; ++i) {
    double norm = 0.0;
    for (std::int64_t a = 0; a < d; ++a) norm += static_cast<double>(x[i * d + a]) * x[i * d + a];
    if (norm == 0.0) continue;
    const float scale = static_cast<float>(1.0 / std::sqrt(norm));
    for (std::int64_t a = 0; a < d; ++a) x[i * d + a] *= scale;
  }
}

}  // namespace

Generation generate_tokens(const Tensor<float>& prompt,
                           const std::vector<flow::FlowLayer<float>>& layers, double beta,
                           bool sphere, std::int64_t count, int threads) {
  const std::int64_t N = prompt.extent(0), d = prompt.extent(1);
  const auto L = static_cast<std::int64_t>(layers.size());
  std::vector<DecodeCache> caches;
  for (const auto& layer : layers) caches.emplace_back(layer.operators(), d, beta);

  Generation out;
  out.paths = Tensor<float>(Shape{count, L + 1, d});
  out.cloud = Tensor<float>(Shape{N + count, d});
  std::copy(prompt.values().begin(), prompt.values().end(), out.cloud.data());

  // The prompt, causally through every layer: each layer's cache holds its input tokens.
  std::vector<float> state(prompt.values().begin(), prompt.values().end());
  std::vector<float> update(state.size());
  for (std::int64_t l = 0; l < L; ++l) {
    caches[static_cast<std::size_t>(l)].append(state.data(), N);
    caches[static_cast<std::size_t>(l)].attend(state.data(), N, Mask::causal(),
                                               {update.data(), nullptr, nullptr, nullptr},
                                               kAlignToEnd, threads);
    for (std::size_t k = 0; k < state.size(); ++k) state[k] += update[k];
    if (sphere) to_sphere(state.data(), N, d);
  }

  // Each new token: the last output, entered at the bottom and moved up the stack.
  std::vector<float> token(state.end() - d, state.end()), delta(static_cast<std::size_t>(d));
  for (std::int64_t t = 0; t < count; ++t) {
    const auto start = std::chrono::steady_clock::now();
    std::copy(token.begin(), token.end(), out.cloud.data() + (N + t) * d);
    float* path = out.paths.data() + t * (L + 1) * d;
    std::copy(token.begin(), token.end(), path);
    for (std::int64_t l = 0; l < L; ++l) {
      DecodeCache& cache = caches[static_cast<std::size_t>(l)];
      cache.append(token.data(), 1);
      cache.attend(token.data(), 1, Mask::causal(), {delta.data(), nullptr, nullptr, nullptr},
                   kAlignToEnd, threads);
      for (std::int64_t a = 0; a < d; ++a) token[static_cast<std::size_t>(a)] += delta[a];
      if (sphere) to_sphere(token.data(), 1, d);
      std::copy(token.begin(), token.end(), path + (l + 1) * d);
    }
    out.seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return out;
}

}  // namespace emflow::cli
