// `emflow flow --model OPS_DIR`: the layers of a converted model (emflow convert) on a token
// cloud, run by cmd_flow_model.cpp; cmd_flow.cpp parses the options.
#pragma once

#include <cstdint>
#include <string>

namespace emflow::cli {

struct ModelFlowArguments {
  std::string model;        ///< the operator folder
  std::string cloud;        ///< (N, d) or (B, N, d), float32 or float64
  std::string key_lengths;  ///< optional (B) int32/int64
  std::string labels;       ///< optional text file (--labels): token strings of cloud 0, one a line
  std::string positions;    ///< optional (B, N) or (N) int32/int64: rotary positions (llama)
  bool attention_only = false;
  /// emf (dense M_h, F_h) or factored (Q/K/V/O blocks); empty: emf, factored for llama
  std::string form;
  std::string out, attention_out, metrics, plot;
  std::string logits;  ///< optional (B, vocab): the last real token's next-token logits
  /// optional: the per-layer histogram of cloud 0's pairwise cosines, as a picture (.png) and
  /// the counts of every cloud (.npy, (L + 1, B, cosine_bins) int64)
  std::string cosine_histogram, cosine_counts;
  std::string device = "auto";
  int threads = 0;
  double cluster_eps = 1e-3;
};

/// The bins of --cosine-histogram and --cosine-counts: 40 of width 0.05 over [-1, 1].
constexpr std::int64_t cosine_bins = 40;

void run_model_flow(const ModelFlowArguments& args);

}  // namespace emflow::cli
