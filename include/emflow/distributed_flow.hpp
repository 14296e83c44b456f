// emflow::distributed: the flow and the phase sweep of emflow::flow across the ranks of a job.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/distributed.hpp"
#include "emflow/flow.hpp"

namespace emflow::distributed {

/// flow::phase_diagram on the CPU path with its (beta, cloud) pairs split across the ranks in
/// near-equal contiguous runs (pair p = k * clouds + c): each rank counts the clustered pairs of
/// its runs (flow::phase_counts), the integer counts are summed exactly across the ranks, and
/// every rank returns the same diagram, bit for bit that of flow::phase_diagram(settings,
/// {Device::cpu}) in one process, for any number of ranks. The settings are checked on every
/// rank and agreed on; progress (steps of this rank's part) may be empty. Collective.
flow::PhaseDiagram phase_diagram(Communicator& comm, const flow::PhaseSettings& settings,
                                 const ExecutionOptions& options = {},
                                 const flow::Progress& progress = {});

/// flow::run_flow with the tokens of every cloud spread over the ranks. Rank r holds the tokens
/// shard(Layout::contiguous, tokens, P, r) of every cloud (the ring's shards of an unmasked
/// cloud; the flow has no mask) and advances them: every attention evaluation is the ring of
/// sequence_parallel.hpp, the integrator, the norms and the sphere projection act on each token
/// where it lives, exactly as in one process. The observables are reduced across the ranks in a
/// fixed order (docs/PERF.md; src/distributed/flow.cpp says what each costs), so two runs with
/// the same rank count agree bit for bit, and they equal flow::run_flow's to rounding (integer
/// counts exactly, as long as no pair lies within rounding of the cluster threshold).
///
/// shard: this rank's rows (batch, n_r, dim), n_r = shard_tokens(shard(...)); tokens: N of the
/// whole cloud, at least the number of ranks. The other arguments are run_flow's and the same on
/// every rank; options.device: cpu, reference or automatic (the host). Every rank checks the
/// arguments and agrees on the outcome, so a bad argument on one rank is the same
/// emflow::Error on every rank. Returns on every rank the times, steps and observables; the
/// trajectory is the whole (R, B, N, d) on rank 0 and this rank's rows (R, B, n_r, d) on every
/// other rank. Collective.
template <class T>
flow::FlowResult<T> run_flow(Communicator& comm, const T* shard, std::int64_t batch,
                             std::int64_t tokens, std::int64_t dim,
                             const std::vector<double>& betas,
                             const std::vector<flow::FlowLayer<T>>& layers,
                             const flow::FlowSettings& settings,
                             const ExecutionOptions& options = {},
                             const flow::Progress& progress = {});

#define EMFLOW_DISTRIBUTED_FLOW_DECLARE(T)                                \
  extern template flow::FlowResult<T> run_flow<T>(                        \
      Communicator&, const T*, std::int64_t, std::int64_t, std::int64_t,  \
      const std::vector<double>&, const std::vector<flow::FlowLayer<T>>&, \
      const flow::FlowSettings&, const ExecutionOptions&, const flow::Progress&);
EMFLOW_DISTRIBUTED_FLOW_DECLARE(float)
EMFLOW_DISTRIBUTED_FLOW_DECLARE(double)
#undef EMFLOW_DISTRIBUTED_FLOW_DECLARE

}  // namespace emflow::distributed
