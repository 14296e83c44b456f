// Pieces of src/flow shared between its files (not part of the public API).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "emflow/flow.hpp"
#include "emflow/flow_parts.hpp"

namespace emflow::flow {

/// phase_diagram's generic path (flow.hpp, PhaseSettings::generic), whatever the device.
PhaseDiagram phase_diagram_generic(const PhaseSettings& settings,
                                   const ExecutionOptions& options = {},
                                   const Progress& progress = {});

}  // namespace emflow::flow

namespace emflow::flow::detail {

/// A seed for stream `stream` of `seed` (splitmix64 twice): independent streams per cloud,
/// per operator, per layer.
std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t stream) noexcept;

/// The end of the run of consecutive clouds from `first` that share its beta: one attention
/// call covers clouds [first, beta_run_end(betas, first)).
inline std::int64_t beta_run_end(const std::vector<double>& betas, std::int64_t first) {
  const auto count = static_cast<std::int64_t>(betas.size());
  std::int64_t end = first + 1;
  while (end < count &&
         betas[static_cast<std::size_t>(end)] == betas[static_cast<std::size_t>(first)])
    ++end;
  return end;
}

/// Checks the arguments of run_flow (the shape of the initial clouds, betas, layers, settings)
/// and returns one beta per cloud; throws emflow::Error naming the first bad argument. Both the
/// host and the CUDA run take their arguments from here, and so does the run across processes.
template <class T>
std::vector<double> validate_flow(const Shape& initial, const std::vector<double>& betas,
                                  const std::vector<FlowLayer<T>>& layers,
                                  const FlowSettings& settings);

/// Number of records of a run of `steps` steps recording every `every`: steps 0, k, 2k, ...
/// and the last one.
std::int64_t record_count(std::int64_t steps, std::int64_t every) noexcept;

/// A result with room for every record of a validated run of B clouds of N tokens in R^d:
/// trajectory (R, B, N, d), times, steps, observables. Refuses trajectories beyond 2^31
/// elements before allocating.
template <class T>
FlowResult<T> allocate_result(std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                              const FlowSettings& settings);

/// Number of continuous steps to reach `time` with step `dt` (the last step may be shorter) and
/// the length of step s.
std::int64_t continuous_steps(double time, double dt) noexcept;
double step_length(double time, double dt, std::int64_t steps, std::int64_t s) noexcept;

/// The run of run_flow on the host (host_ops.cpp), on arguments validate_flow has accepted
/// (`betas`: one per cloud).
template <class T>
FlowResult<T> run_flow_host(const Tensor<T>& initial, const std::vector<double>& betas,
                            const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings,
                            const ExecutionOptions& options, const Progress& progress);

/// Rows [first, first + count) of a cloud (emflow/flow_parts.hpp).
using RowRun = ::emflow::flow::RowRun;

/// What the pairs (i, j > i) with i in some rows of a cloud contribute to its observables
/// (observe() is one part over every row; a cloud split among processes adds the parts of
/// rows that cover it once). The clustered pairs are joined in a forest over the whole cloud.
struct PairPart {
  double min_inner = std::numeric_limits<double>::infinity();
  double sum_inner = 0.0;
  double energy = 0.0;  ///< exp(beta |x_i|^2) of the part's rows, then 2 exp(beta <x_i, x_j>)
  double diameter_sq = 0.0;
  std::int64_t clustered = 0;        ///< clustered pairs (exact)
  std::int64_t joins = 0;            ///< joins that merged two components (N - clusters)
  std::vector<std::int64_t> parent;  ///< the forest: N entries, each tree one component
};

/// ||x_i|| of the N tokens of x (N x d, in double).
std::vector<double> token_norms(const double* x, std::int64_t N, std::int64_t d);
/// The part of the rows `rows` of the cloud x (N x d; norms from token_norms), each sum over
/// rows in the order given, pairs (i, j > i) with j ascending: the order of observe().
PairPart pair_part(const double* x, const double* norms, std::int64_t N, std::int64_t d,
                   double beta, double cluster_eps, const std::vector<RowRun>& rows);
/// The joins that merge the components of the union of the forests (PairPart::parent) of the
/// parts of one cloud of N tokens: clusters = N - merged_joins. Exact, in any order.
std::int64_t merged_joins(std::int64_t N, const std::vector<const std::int64_t*>& forests);
/// The observables (entropy 0) of a cloud of N tokens from the sums of all its pairs.
Observables finish_observables(const PairPart& sums, std::int64_t N, double beta);

/// The generic phase sweep (phase_diagram_generic): every cloud of every beta in one batch of
/// B = K * C clouds sorted by beta, SA on the sphere with Q = K = V = I, RK4.
struct PhaseProblem {
  std::vector<float> clouds;  ///< (B, N, d): the C initial clouds, repeated for each beta
  std::vector<double> betas;  ///< B entries, one per cloud
  std::int64_t batch = 0, tokens = 0, dim = 0;
  std::int64_t clouds_per_beta = 0, beta_count = 0;
  std::int64_t steps = 0;  ///< continuous_steps(time, dt)
  double time = 0, dt = 0;
  double threshold = 0;  ///< a pair is clustered when <x_i, x_j> > threshold (1 - eps)
};

/// Row `step` of the diagram from the clouds (B, N, d) on the host: for each beta the mean over
/// its clouds of the fraction of clustered pairs, into row[0, K).
void count_clustered(const PhaseProblem& problem, const float* clouds, double* row);

/// The generic sweep on the host (host_ops.cpp), every evaluation an emflow::attend call on
/// options.device: the diagram (S + 1, K).
std::vector<double> phase_generic_host(const PhaseProblem& problem, const ExecutionOptions& options,
                                       const Progress& progress);

#if EMFLOW_WITH_CUDA
/// The device-resident run of run_flow (src/cuda/flow_ops.cpp), on validated arguments.
template <class T>
FlowResult<T> run_flow_device(const Tensor<T>& initial, const std::vector<double>& betas,
                              const std::vector<FlowLayer<T>>& layers, const FlowSettings& settings,
                              const Progress& progress);

/// The generic sweep on the CUDA device (src/cuda/flow_ops.cpp): the state stays in device memory,
/// each step's clouds come back once for the count.
std::vector<double> phase_generic_device(const PhaseProblem& problem, const Progress& progress);
#endif

/// The specialised phase sweep (sphere_kernel.cpp): Q = K = V = I, SA on the sphere, RK4, in
/// float32 with clouds in SIMD lanes. initial: (C, N, d), the same clouds for every beta.
/// Returns the clustered fractions (S + 1, K), averaged over the C clouds.
std::vector<double> phase_kernel(const std::vector<float>& initial, std::int64_t clouds,
                                 std::int64_t tokens, std::int64_t dim,
                                 const std::vector<double>& betas, double time, double dt,
                                 double cluster_eps, int threads, const Progress& progress);
/// The clustered-pair counts (S + 1, K) of the (beta, cloud) pairs p = k * C + c in
/// [first, last) of that sweep, summed over each beta's clouds in the part; phase_kernel is
/// phase_fractions of the counts of all pairs.
std::vector<std::int64_t> phase_counts_kernel(const std::vector<float>& initial,
                                              std::int64_t clouds, std::int64_t tokens,
                                              std::int64_t dim, const std::vector<double>& betas,
                                              double time, double dt, double cluster_eps,
                                              int threads, const Progress& progress,
                                              std::int64_t first, std::int64_t last);
/// Refuses (ErrorCode::out_of_memory), before any allocation, a sweep whose `what` needs more
/// than the memory available, naming the largest of its factors (clouds, betas, tokens, dim).
void expect_sweep_fits(const PhaseSettings& settings, std::int64_t bytes, const char* what);

/// Bytes of working memory phase_counts_kernel takes for clouds of N tokens in R^d on `threads`
/// threads (0: the OpenMP default): one block of SIMD lanes of RK4 state per thread.
std::int64_t phase_kernel_bytes(std::int64_t tokens, std::int64_t dim, int threads);
/// count / (N (N - 1) / 2) / C for every entry.
std::vector<double> phase_fractions(const std::vector<std::int64_t>& counts, std::int64_t clouds,
                                    std::int64_t tokens);

}  // namespace emflow::flow::detail
