// emflow::distributed: the phase sweep of emflow::flow across the ranks of a job.
#pragma once

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

}  // namespace emflow::distributed
