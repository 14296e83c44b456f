// The job of `--distributed` runs: every process that mpirun started, over MPI_COMM_WORLD.
#pragma once

#include "emflow/distributed.hpp"

namespace emflow::cli {

/// The job's communicator; starts MPI on the first call (throws ErrorCode::unsupported when
/// emflow is built without MPI).
distributed::Communicator& job();
/// Whether job() has been called.
bool in_job() noexcept;
/// This process's rank in the job, 0 outside one.
int job_rank() noexcept;
/// Ends MPI normally (every rank, after the command).
void end_job() noexcept;

}  // namespace emflow::cli
