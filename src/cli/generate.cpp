#include "generate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "emflow/attention.hpp"
#include "emflow/decode.hpp"
#include "tools/plot.hpp"

namespace emflow::cli {

namespace {

std::string csv_number(double v) {  // as the flow's tables write numbers
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char text[40];
  std::snprintf(text, sizeof text, "%.9g", v);
  return text;
}

/// One layer's step on `rows` tokens of one cloud (count x d): the attended tokens appended to
/// the layer's cache, then x updated in place. entropy: heads x count, or null.
void layer_step(DecodeCache& cache, const flow::FlowLayer<float>& layer,
                const GenerationSettings& s, float* x, std::int64_t count, std::int64_t d,
                std::vector<float>& normed, std::vector<float>& update, float* entropy) {
  const float* gain = layer.norm_gain.empty() ? nullptr : layer.norm_gain.data();
  const float* bias = layer.norm_bias.empty() ? nullptr : layer.norm_bias.data();
  const auto n = static_cast<std::size_t>(count * d);
  update.resize(n);
  const float* attended = x;
  if (s.pre_norm) {
    normed.assign(x, x + n);
    flow::normalize(s.norm, normed.data(), count, d, gain, bias, s.norm_eps);
    attended = normed.data();
  }
  cache.append(attended, count);
  cache.attend(attended, count, Mask::causal(), {update.data(), nullptr, entropy, nullptr},
               kAlignToEnd, s.threads);
  for (std::size_t k = 0; k < n; ++k) x[k] += update[k];
  if (!s.pre_norm) flow::normalize(s.norm, x, count, d, gain, bias, s.norm_eps);
}

}  // namespace

Generation generate_tokens(const Tensor<float>& prompts,
                           const std::vector<flow::FlowLayer<float>>& layers,
                           const GenerationSettings& s) {
  const std::int64_t B = prompts.extent(0), N = prompts.extent(1), d = prompts.extent(2);
  const std::int64_t L = s.layers, K = s.count;
  const auto layer_of = [&](std::int64_t l) -> const flow::FlowLayer<float>& {
    return layers[layers.size() == 1 ? 0 : static_cast<std::size_t>(l)];
  };
  Generation out;
  out.clouds = B;
  out.prompt_tokens = N;
  out.layers = L;
  out.dim = d;
  out.paths = B == 1 ? Tensor<float>(Shape{K, L + 1, d}) : Tensor<float>(Shape{B, K, L + 1, d});
  out.entropy.assign(static_cast<std::size_t>(B * K * L), 0.0);
  out.seconds.assign(static_cast<std::size_t>(K), 0.0);

  std::vector<std::vector<DecodeCache>> caches(static_cast<std::size_t>(B));
  std::vector<std::vector<float>> tokens(static_cast<std::size_t>(B));
  std::vector<float> normed, update;
  for (std::int64_t b = 0; b < B; ++b) {
    const double beta = s.betas[s.betas.size() == 1 ? 0 : static_cast<std::size_t>(b)];
    auto& stack = caches[static_cast<std::size_t>(b)];
    for (std::int64_t l = 0; l < L; ++l) stack.emplace_back(layer_of(l).operators(), d, beta);
    // The prompt, causally through every layer.
    std::vector<float> state(prompts.data() + b * N * d, prompts.data() + (b + 1) * N * d);
    for (std::int64_t l = 0; l < L; ++l) {
      layer_step(stack[static_cast<std::size_t>(l)], layer_of(l), s, state.data(), N, d, normed,
                 update, nullptr);
    }
    tokens[static_cast<std::size_t>(b)].assign(state.end() - d, state.end());
  }

  // Each new token: the last output, entered at the bottom and moved up the stack.
  std::int64_t heads_max = 1;
  for (const auto& layer : layers) heads_max = std::max(heads_max, layer.heads);
  std::vector<float> entropy(static_cast<std::size_t>(heads_max));
  for (std::int64_t t = 0; t < K; ++t) {
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t b = 0; b < B; ++b) {
      std::vector<float>& token = tokens[static_cast<std::size_t>(b)];
      float* path = out.paths.data() + (b * K + t) * (L + 1) * d;
      std::copy(token.begin(), token.end(), path);
      for (std::int64_t l = 0; l < L; ++l) {
        const auto& layer = layer_of(l);
        layer_step(caches[static_cast<std::size_t>(b)][static_cast<std::size_t>(l)], layer, s,
                   token.data(), 1, d, normed, update, entropy.data());
        double mean = 0.0;
        for (std::int64_t h = 0; h < layer.heads; ++h) mean += entropy[static_cast<std::size_t>(h)];
        out.entropy[static_cast<std::size_t>((b * K + t) * L + l)] = mean / layer.heads;
        std::copy(token.begin(), token.end(), path + (l + 1) * d);
      }
    }
    out.seconds[static_cast<std::size_t>(t)] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return out;
}

std::string generation_metrics(const Generation& g) {
  const std::int64_t B = g.clouds, N = g.prompt_tokens, L = g.layers, d = g.dim;
  const auto K = static_cast<std::int64_t>(g.seconds.size());
  std::ostringstream csv;
  csv << (B > 1 ? "cloud," : "") << "token,position,layer,move,seconds\n";
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < K; ++t) {
      const float* path = g.paths.data() + (b * K + t) * (L + 1) * d;
      for (std::int64_t l = 0; l < L; ++l) {
        double move = 0.0;
        for (std::int64_t a = 0; a < d; ++a) {
          const double step = path[(l + 1) * d + a] - path[l * d + a];
          move += step * step;
        }
        if (B > 1) csv << b << ',';
        csv << t << ',' << N + t << ',' << l << ',' << csv_number(std::sqrt(move)) << ','
            << csv_number(g.seconds[static_cast<std::size_t>(t)]) << '\n';
      }
    }
  }
  return csv.str();
}

std::string generation_picture(const Generation& g, const std::string& title) {
  const std::int64_t L = g.layers, d = g.dim;
  const auto K = static_cast<std::int64_t>(g.seconds.size());
  tools::ModelPicture picture;
  picture.records = L + 1;
  picture.tokens = K;
  picture.dim = d;
  picture.trajectory.resize(static_cast<std::size_t>((L + 1) * K * d));
  std::vector<float> record(static_cast<std::size_t>(K * d));
  for (std::int64_t r = 0; r <= L; ++r) {
    for (std::int64_t t = 0; t < K; ++t) {
      for (std::int64_t a = 0; a < d; ++a) {
        const float v = g.paths[(t * (L + 1) + r) * d + a];  // cloud 0
        picture.trajectory[static_cast<std::size_t>((r * K + t) * d + a)] = v;
        record[static_cast<std::size_t>(t * d + a)] = v;
      }
    }
    // A layer's entropy is that of the tokens it moved (the last record: none).
    double entropy = 0.0;
    if (r < L) {
      for (std::int64_t t = 0; t < K; ++t)
        entropy += g.entropy[static_cast<std::size_t>(t * L + r)];
      entropy /= static_cast<double>(K);
    }
    picture.entropy.push_back(entropy);
    picture.clusters.push_back(K >= 2 ? flow::observe(record.data(), K, d, 1.0).clusters : 1);
  }
  for (std::int64_t t = 0; t < K; ++t)
    picture.labels.push_back(std::to_string(g.prompt_tokens + t));
  picture.title = title;
  return tools::draw_model_flow(picture);
}

}  // namespace emflow::cli
