// What `emflow flow` (cmd_flow.cpp) and its run across the ranks of an MPI job
// (cmd_flow_distributed.cpp) share: the arguments, the settings and layers they give, and the
// files a finished run writes, so that both runs write the same files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli11_fwd.hpp"
#include "common.hpp"
#include "emflow/flow.hpp"
#include "emflow/io.hpp"
#include "flow_model.hpp"

namespace emflow::cli {

struct FlowArguments {
  std::string cloud;
  std::int64_t tokens = 32, dim = 3, batch = 1;
  std::string init = "sphere";
  std::uint64_t seed = 0;
  std::int64_t layers = 0;
  double time = 10.0, dt = 0.1;
  std::string integrator = "rk4";
  std::string relevance = "identity", content = "identity";
  std::string beta = "1";
  std::string norm = "sphere";  // the default run is the sphere dynamics of docs/MATH.md §4
  double norm_eps = 1e-5;
  bool pre_norm = false, unnormalized = false;
  bool check_finite = false;
  std::int64_t record_every = 1;
  std::int64_t generate = 0;  // given: causal generation of this many tokens (emflow::generate)
  std::string device = "auto";
  int threads = 0;
  std::string precision = "float32";
  std::string out, metrics, plot;
  ModelFlowArguments model;  // --model: a converted model's layers (cmd_flow_model.cpp)
  bool full_layer = false;
  bool distributed = false;  // under mpirun: the tokens spread over the ranks
  // Which of the mutually dependent options the user gave.
  CLI::Option *tokens_option = nullptr, *dim_option = nullptr, *init_option = nullptr,
              *batch_option = nullptr, *layers_option = nullptr, *time_option = nullptr,
              *dt_option = nullptr, *integrator_option = nullptr, *precision_option = nullptr,
              *record_every_option = nullptr, *generate_option = nullptr;
};

/// Is `text` the name of a generated operator (identity, minus-identity, random)?
bool is_generated(const std::string& text);

/// The kind of generated cloud, after checking --tokens, --dim, --batch and --init (without
/// --x), each named when wrong.
flow::InitialCloud check_generated_cloud(const FlowArguments& args);

/// "1", or "0.5,1,2" (one per cloud).
std::vector<double> parse_betas(const std::string& text, std::int64_t batch);

/// The operators of every layer (flow::layer_stack): generated, or read from --m / --f files of
/// shape (d, d), (H, d, d), or (L, H, d, d) for a stack of L layers each with its own heads.
template <class T>
std::vector<flow::FlowLayer<T>> read_layers(const FlowArguments& args, std::int64_t dim,
                                            std::int64_t layer_count, Dtype dtype);

/// A number as the metrics file writes it (%.9g; nan, inf, -inf).
std::string csv_number(double v);

/// The run's settings from the options, each checked and named when wrong.
flow::FlowSettings flow_settings(const FlowArguments& args);

/// The values of the trajectory of B clouds of N tokens in R^d (and its records into
/// `records`); refuses more than 2^31, naming the options to change.
std::int64_t trajectory_values(const FlowArguments& args, const flow::FlowSettings& settings,
                               std::int64_t B, std::int64_t N, std::int64_t d, bool from_file,
                               std::int64_t* records);

/// Declares the run's outputs (--out, --metrics, --plot, as given) and its input files (--x, and
/// --m / --f unless generated) in `outputs`, before anything is read.
void declare_flow_files(OutputFiles& outputs, const FlowArguments& args);

/// Stages --out, --metrics and --plot of a finished run (the whole trajectory).
template <class T>
void stage_flow_outputs(OutputFiles& outputs, const FlowArguments& args,
                        const flow::FlowResult<T>& result, const std::vector<double>& betas,
                        const flow::FlowSettings& settings);

/// `emflow flow --distributed` (cmd_flow_distributed.cpp): each rank reads its shard of --x (or
/// takes its rows of the generated clouds), the ranks run distributed::run_flow, and rank 0
/// writes the outputs once, all or none; every error is agreed on by every rank.
void run_flow_distributed(const FlowArguments& args);

}  // namespace emflow::cli
