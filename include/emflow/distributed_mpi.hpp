// emflow::distributed over MPI: a communicator over the caller's MPI communicator (CPU ranks,
// host memory). Available when emflow is built with MPI (EMFLOW_WITH_MPI, built_with_mpi()).
#pragma once

#include <mpi.h>

#include <memory>

#include "emflow/distributed.hpp"

namespace emflow::distributed {

/// A communicator over `comm` (collective over it). emflow works on its own duplicate of `comm`
/// (MPI_Comm_dup), so its messages never meet the caller's; the duplicate is freed when the
/// returned object is destroyed, which must happen before MPI_Finalize. MPI must be initialised;
/// the calls come from the thread that calls emflow (MPI_THREAD_FUNNELED is enough). MPI errors
/// are reported as emflow::Error (ErrorCode::io) on the rank that sees them.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm);

}  // namespace emflow::distributed
