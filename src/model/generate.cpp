// Decoding through a stack of layers (emflow/generate.hpp): one DecodeCache per layer, the
// layer's norm and residual around it on the host, and the flow's generation on top.
#include "emflow/generate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "core/check.hpp"
#include "core/memory.hpp"

namespace emflow {

namespace {

using detail::checked_multiply;
using detail::fail_argument;

constexpr const char* kStack = "DecodingStack";

void check_layers(const char* op, const std::vector<flow::FlowLayer<float>>& layers,
                  std::int64_t d) {
  if (layers.empty()) fail_argument(op, "layers", "must hold at least one layer, got none");
  for (std::size_t index = 0; index < layers.size(); ++index) {
    const flow::FlowLayer<float>& layer = layers[index];
    const std::int64_t H = layer.heads;
    if (H < 1) fail_argument(op, "layers", "layer ", index, ": heads must be >= 1, got ", H);
    const std::int64_t square =
        checked_multiply(op, "layers", checked_multiply(op, "layers", H, d), d);
    auto expect = [&](const char* name, std::size_t size, std::int64_t want, bool optional) {
      if ((optional && size == 0) || static_cast<std::int64_t>(size) == want) return;
      fail_argument(op, "layers", "layer ", index, ": ", name, " has ", size, " entries, expected ",
                    want, optional ? " or none" : "");
    };
    expect("relevance", layer.relevance.size(), square, false);
    expect("content", layer.content.size(), square, false);
    expect("key_bias", layer.key_bias.size(), H * d, true);
    expect("offset", layer.offset.size(), d, true);
    expect("norm_gain", layer.norm_gain.size(), d, true);
    expect("norm_bias", layer.norm_bias.size(), d, true);
  }
}

const float* or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

}  // namespace

struct DecodingStack::State {
  std::vector<flow::FlowLayer<float>> layers;
  std::vector<DecodeCache> caches;
  std::int64_t dim = 0;
  double beta = 1.0;
  DecodingSettings settings;
  std::vector<float> normed, update, entropy;  // scratch of forward()
};

DecodingStack::DecodingStack(std::vector<flow::FlowLayer<float>> layers, std::int64_t dim,
                             double beta, const DecodingSettings& settings)
    : state_(std::make_unique<State>()) {
  detail::expect_positive(kStack, "dim", dim);
  if (!std::isfinite(beta)) fail_argument(kStack, "beta", "must be finite, got ", beta);
  if (!(std::isfinite(settings.norm_eps) && settings.norm_eps > 0.0)) {
    fail_argument(kStack, "norm_eps", "must be finite and > 0, got ", settings.norm_eps);
  }
  check_threads(settings.threads, kStack);
  check_layers(kStack, layers, dim);
  State& s = *state_;
  s.layers = std::move(layers);
  s.dim = dim;
  s.beta = beta;
  s.settings = settings;
  s.caches.reserve(s.layers.size());
  for (const flow::FlowLayer<float>& layer : s.layers) {
    s.caches.emplace_back(layer.operators(), dim, beta, settings.cache);
  }
}

DecodingStack::~DecodingStack() = default;
DecodingStack::DecodingStack(DecodingStack&&) noexcept = default;
DecodingStack& DecodingStack::operator=(DecodingStack&&) noexcept = default;

std::int64_t DecodingStack::layers() const noexcept {
  return static_cast<std::int64_t>(state_->layers.size());
}
std::int64_t DecodingStack::dim() const noexcept { return state_->dim; }
double DecodingStack::beta() const noexcept { return state_->beta; }
const DecodingSettings& DecodingStack::settings() const noexcept { return state_->settings; }
std::int64_t DecodingStack::size() const noexcept { return state_->caches.front().size(); }

const DecodeCache& DecodingStack::cache(std::int64_t layer) const {
  if (layer < 0 || layer >= layers()) {
    fail_argument(kStack, "layer", "must be in [0, ", layers() - 1, "], got ", layer);
  }
  return state_->caches[static_cast<std::size_t>(layer)];
}

void DecodingStack::forward(float* tokens, std::int64_t count, const DecodingTrace& trace) {
  detail::expect_positive(kStack, "count", count);
  detail::expect_not_null(kStack, "tokens", tokens);
  State& s = *state_;
  const DecodingSettings& set = s.settings;
  const std::int64_t d = s.dim, L = layers();
  const auto n = static_cast<std::size_t>(checked_multiply(kStack, "count", count, d));
  s.update.resize(n);
  if (set.pre_norm) s.normed.resize(n);
  const auto record_path = [&](std::int64_t slot) {
    if (trace.paths == nullptr) return;
    for (std::int64_t t = 0; t < count; ++t) {
      std::copy(tokens + t * d, tokens + (t + 1) * d, trace.paths + (t * (L + 1) + slot) * d);
    }
  };
  for (std::int64_t l = 0; l < L; ++l) {
    const flow::FlowLayer<float>& layer = s.layers[static_cast<std::size_t>(l)];
    DecodeCache& cache = s.caches[static_cast<std::size_t>(l)];
    record_path(l);
    const float* attended = tokens;
    if (set.pre_norm) {
      std::copy(tokens, tokens + n, s.normed.begin());
      flow::normalize(set.norm, s.normed.data(), count, d, or_null(layer.norm_gain),
                      or_null(layer.norm_bias), set.norm_eps);
      attended = s.normed.data();
    }
    float* entropy = nullptr;
    if (trace.entropy != nullptr) {
      s.entropy.resize(static_cast<std::size_t>(layer.heads * count));
      entropy = s.entropy.data();
    }
    cache.append(attended, count);
    cache.attend(attended, count, Mask::causal(), {s.update.data(), nullptr, entropy, nullptr},
                 kAlignToEnd, set.threads);
    for (std::size_t k = 0; k < n; ++k) tokens[k] += s.update[k];
    if (!set.pre_norm) {
      flow::normalize(set.norm, tokens, count, d, or_null(layer.norm_gain),
                      or_null(layer.norm_bias), set.norm_eps);
    }
    if (entropy != nullptr) {
      // entropy: (heads, count); the mean over the heads, in head order.
      for (std::int64_t t = 0; t < count; ++t) {
        double sum = 0.0;
        for (std::int64_t h = 0; h < layer.heads; ++h) sum += entropy[h * count + t];
        trace.entropy[t * L + l] = sum / static_cast<double>(layer.heads);
      }
    }
  }
  record_path(L);
}

void DecodingStack::clear() noexcept {
  for (DecodeCache& cache : state_->caches) cache.clear();
}

Generation generate(const Tensor<float>& prompts, const std::vector<flow::FlowLayer<float>>& layers,
                    const std::vector<double>& betas, std::int64_t steps,
                    const DecodingSettings& settings) {
  const char* op = "generate";
  if (prompts.rank() != 3 || prompts.extent(1) < 1 || prompts.extent(2) < 1 ||
      prompts.extent(0) < 1) {
    fail_argument(op, "prompts", "must have shape (B, N, d) with B, N, d >= 1, got ",
                  to_string(prompts.shape()));
  }
  const std::int64_t B = prompts.extent(0), N = prompts.extent(1), d = prompts.extent(2);
  if (betas.size() != 1 && static_cast<std::int64_t>(betas.size()) != B) {
    fail_argument(op, "betas", "must have 1 or B (", B, ") entries, got ", betas.size());
  }
  if (steps < 0) fail_argument(op, "steps", "must be >= 0, got ", steps);
  check_layers(op, layers, d);
  const auto L = static_cast<std::int64_t>(layers.size());

  // Every size before any work, in 4-byte values: the paths, the entropies and seconds (8 bytes
  // each), and the caches at the most they may grow to. A cache holds each token's key (d floats)
  // and its content per head, a row padded to a whole number of the CPU engine's widest vector
  // (16 floats), and grows by doubling: up to twice the tokens it holds.
  const std::int64_t paths = detail::checked_product(op, "steps", Shape{B, steps, L + 1, d});
  const std::int64_t rows = checked_multiply(op, "steps", 2 * B, N + steps);
  const std::int64_t padded = (d + 15) / 16 * 16;
  std::int64_t values = paths;
  const auto add = [&](std::int64_t more) {
    if (__builtin_add_overflow(values, more, &values)) {
      fail_argument(op, "steps", "gives more than 2^63 values to hold");
    }
  };
  add(checked_multiply(op, "steps", 2, checked_multiply(op, "steps", B * steps, L + 1)));
  for (const flow::FlowLayer<float>& layer : layers) {
    add(checked_multiply(op, "steps", rows,
                         d + checked_multiply(op, "layers", layer.heads, padded)));
  }
  detail::expect_fits_in_memory(op,
                                "the generation (paths of B K (L + 1) d values, entropies, and "
                                "per layer B decode caches of up to 2 (N + K) tokens of "
                                "d + 16 ceil(d / 16) H floats)",
                                values, sizeof(float));

  DecodingSettings s = settings;
  if (s.cache.device == Device::cuda && s.cache.capacity == 0) s.cache.capacity = N + steps;
  std::vector<DecodingStack> stacks;
  stacks.reserve(static_cast<std::size_t>(B));
  for (std::int64_t b = 0; b < B; ++b) {
    stacks.emplace_back(layers, d, betas[betas.size() == 1 ? 0 : static_cast<std::size_t>(b)], s);
  }

  Generation g;
  g.clouds = B;
  g.prompt_tokens = N;
  g.layers = L;
  g.dim = d;
  g.steps = steps;
  g.paths = Tensor<float>(Shape{B, steps, L + 1, d});
  g.entropy.assign(static_cast<std::size_t>(B * steps * L), 0.0);
  g.seconds.assign(static_cast<std::size_t>(steps), 0.0);

  // The prompts, then each cloud's last output as its next token.
  std::vector<std::vector<float>> next(static_cast<std::size_t>(B));
  for (std::int64_t b = 0; b < B; ++b) {
    std::vector<float> state(prompts.data() + b * N * d, prompts.data() + (b + 1) * N * d);
    stacks[static_cast<std::size_t>(b)].forward(state.data(), N);
    next[static_cast<std::size_t>(b)].assign(state.end() - d, state.end());
  }
  for (std::int64_t t = 0; t < steps; ++t) {
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t b = 0; b < B; ++b) {
      DecodingTrace trace;
      trace.paths = g.paths.data() + (b * steps + t) * (L + 1) * d;
      trace.entropy = g.entropy.data() + (b * steps + t) * L;
      stacks[static_cast<std::size_t>(b)].forward(next[static_cast<std::size_t>(b)].data(), 1,
                                                  trace);
    }
    g.seconds[static_cast<std::size_t>(t)] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return g;
}

}  // namespace emflow
