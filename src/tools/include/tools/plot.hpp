// Pictures of the flow drawn with cairo, returned as PNG bytes so that the caller writes them
// atomically with its other outputs (emflow::OutputFiles).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emflow/flow.hpp"

namespace emflow::tools {

/// What the flow picture shows: the trajectory of one cloud and the observables of every cloud.
struct FlowPicture {
  std::int64_t records = 0, clouds = 0, tokens = 0, dim = 0;
  std::vector<double> trajectory;  ///< (records, tokens, dim): the cloud drawn on the left
  std::vector<double> times;       ///< records
  std::vector<double> betas;       ///< clouds
  std::vector<flow::Observables> observables;  ///< records * clouds, record r of cloud b at r*B+b
  bool on_sphere = false;                      ///< the tokens live on the unit sphere
  std::string time_label = "time t";
  std::string title;
};

/// Left: the cloud's tokens over time, drawn in its plane for d = 2, on an orthographic sphere
/// for d = 3 on the sphere, else projected onto the two principal directions of all its
/// recorded positions. Right: the observables over time. Returns PNG bytes.
std::string draw_flow(const FlowPicture& picture);

/// What the picture of a model's flow shows: one cloud of real tokens after every layer.
struct ModelPicture {
  std::int64_t records = 0, tokens = 0, dim = 0;
  std::vector<double> trajectory;      ///< (records, tokens, dim)
  std::vector<std::string> labels;     ///< token strings (tokens), or empty
  std::vector<double> entropy;         ///< records: mean attention entropy of layer r (last: 0)
  std::vector<std::int64_t> clusters;  ///< records
  std::vector<double> effective_rank;  ///< records (tools/cloud_statistics.hpp), or empty
  double cluster_eps = 1e-3;
  std::string title;
};

/// Left: the cloud after every layer in one fixed 2-D projection (the two principal directions
/// of all the records' unit token directions, each record centred), tokens labelled, in a grid
/// of up to eight panels a row. Right: per layer the mean and min pairwise cosine, the clusters,
/// the effective rank (when given) and the attention entropy. PNG bytes.
std::string draw_model_flow(const ModelPicture& picture);

/// What the histogram picture of a model's flow shows: one cloud's pairwise cosines per layer.
struct CosineHistogramPicture {
  std::int64_t records = 0, bins = 0;
  std::vector<std::int64_t> counts;  ///< (records, bins): tools::cosine_histogram of record r
  std::vector<double> mean_cosine;   ///< records: the mean pairwise cosine, marked on each row
  std::string title;
};

/// A heat map, layer (rows, the input at the top) by cosine bin over [-1, 1] (columns): the
/// fraction of the record's pairs in each bin, in viridis with a colour bar, and a mark at each
/// row's mean cosine. PNG bytes.
std::string draw_cosine_histogram(const CosineHistogramPicture& picture);

/// The phase diagram: fraction of clustered pairs over (time, beta), with a colour bar.
std::string draw_phase(const flow::PhaseDiagram& diagram, const std::string& title);

/// `n` in Unicode superscript digits, e.g. for S^{d-1}.
std::string superscript(long long n);

}  // namespace emflow::tools
