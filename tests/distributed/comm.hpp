// The communicator every distributed test runs over: MPI_COMM_WORLD under mpirun (one process
// alone is a world of one), the single-process communicator in a build without MPI.
#pragma once

#include <memory>

#include "emflow/distributed.hpp"

namespace emflow::testing {

distributed::Communicator& comm();
std::unique_ptr<distributed::Communicator>& world_communicator();

}  // namespace emflow::testing
