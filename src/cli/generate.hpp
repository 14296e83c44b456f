// emflow flow --generate K: causal generation through a stack of layers with one DecodeCache
// per layer (include/emflow/decode.hpp), so each new token costs O(L N d) instead of a rerun.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/flow.hpp"
#include "emflow/tensor.hpp"

namespace emflow::cli {

/// What a generation run produces.
struct Generation {
  Tensor<float> paths;  ///< (K, L + 1, d): each new token at the input of every layer and after
  Tensor<float> cloud;  ///< (N + K, d): the prompt and the generated tokens, as entered
  std::vector<double> seconds;  ///< per generated token, wall-clock
};

/// Runs the prompt (N, d) through the layers causally (post-norm, x <- N(x + Delta(x)), the
/// normalization `sphere` or none), keeping each layer's input tokens in its cache; then K times
/// takes the last token's output as the next token, appends it at every layer and moves it
/// through the stack against everything before it.
Generation generate_tokens(const Tensor<float>& prompt,
                           const std::vector<flow::FlowLayer<float>>& layers, double beta,
                           bool sphere, std::int64_t count, int threads);

}  // namespace emflow::cli
