// emflow flow --generate K: causal generation through a stack of layers with one DecodeCache
// per layer and cloud (include/emflow/decode.hpp), so each new token costs O(L N d) instead of a
// rerun.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emflow/flow.hpp"
#include "emflow/tensor.hpp"

namespace emflow::cli {

/// How the stack runs: post-norm x <- N(x + Delta(x)) or pre-norm x <- x + Delta(N(x)), N any
/// of the flow's normalizations (with each layer's gain and bias), and one beta per cloud.
struct GenerationSettings {
  flow::Normalization norm = flow::Normalization::sphere;
  bool pre_norm = false;
  double norm_eps = 1e-5;
  std::vector<double> betas;  ///< one per cloud, or one for all
  std::int64_t layers = 1;    ///< L: `layers` holds L layers, or 1 shared by all
  std::int64_t count = 1;     ///< K tokens to generate
  int threads = 0;
};

/// What a generation run produces.
struct Generation {
  std::int64_t clouds = 1, prompt_tokens = 0, layers = 0, dim = 0;
  /// (K, L + 1, d) for one cloud, (B, K, L + 1, d) for several: each new token at the input of
  /// every layer and after the last.
  Tensor<float> paths;
  std::vector<double> seconds;  ///< per generated token (all clouds), wall-clock
  std::vector<double> entropy;  ///< (B, K, L): the new token's attention entropy, mean over heads
};

/// Runs the prompts (B, N, d) through the layers causally, keeping each layer's attended tokens
/// (its input post-norm, the normalized input pre-norm) in its cache; then K times takes each
/// cloud's last output as its next token, appends it at every layer and moves it through the
/// stack against everything before it.
Generation generate_tokens(const Tensor<float>& prompts,
                           const std::vector<flow::FlowLayer<float>>& layers,
                           const GenerationSettings& settings);

/// The --metrics table: token, position, layer, move (how far the layer moved it), seconds; with
/// several clouds a leading cloud column.
std::string generation_metrics(const Generation& g);

/// The picture of cloud 0's new tokens moving through the stack (PNG bytes): each token's path
/// over the layers and, per layer, its pairwise cosines, clusters and attention entropy.
std::string generation_picture(const Generation& g, const std::string& title);

}  // namespace emflow::cli
