// emflow::distributed over NCCL: a communicator over the caller's ncclComm_t and CUDA stream
// (GPU ranks, device memory), and the bootstrap of one from a host communicator (MPI) for
// callers who have only that. Available when emflow is built with NCCL (built_with_nccl()).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>

#include "emflow/distributed.hpp"

namespace emflow::distributed {

/// A communicator over `comm` whose work is ordered on `stream`, the caller's compute stream.
/// Buffers of start_shift, broadcast and gather are device memory (memory() == Memory::device);
/// the reductions take host memory and wait for their result. A ring transfer runs on a second
/// stream of the communicator's own: start_shift records an event on `stream` (the data to send
/// is ready), makes the second stream wait for it and enqueues the send and receive there;
/// wait() makes `stream` wait for the transfer's event, without blocking the host, so kernels
/// enqueued on `stream` between the two overlap the transfer. The caller keeps `comm` alive and
/// destroys it; the stream must belong to the current device, which `comm` was made on.
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, cudaStream_t stream);

/// The same over an NCCL communicator of its own, bootstrapped over `host` (an MPI communicator
/// of the same ranks, say): rank 0 makes the unique id (ncclGetUniqueId), host.broadcast gives it
/// to every rank, and each calls ncclCommInitRank on the current device. The NCCL communicator
/// is destroyed with the returned object. Collective over `host`; errors are agreed on `host`,
/// so a rank that fails to start makes every rank throw.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, cudaStream_t stream);

}  // namespace emflow::distributed
