// emflow::distributed: the seam between emflow's algorithms and a transport between processes
// (MPI for CPU ranks, NCCL for GPU ranks; distributed_mpi.hpp, distributed_nccl.hpp), and the
// single-process implementation. Part of the library emflow::distributed, which the core library
// does not depend on.
//
// Every operation is collective except start_shift / wait: every rank calls it at the same point
// of its program with arguments of the same shape. Reductions of doubles run in a fixed order
// (rank 0 first, then 1, ...) whatever the transport, so a result does not depend on timing or on
// which rank finished first: two runs with the same rank count agree bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "emflow/error.hpp"

namespace emflow::distributed {

/// Where a buffer lives: host memory (single process, MPI) or device memory (NCCL).
enum class Memory { host, device };

/// A ring transfer in flight (start_shift); wait() completes it.
class Transfer {
 public:
  virtual ~Transfer() = default;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Where the buffers of start_shift / broadcast / gather must be.
  virtual Memory memory() const = 0;

  /// Starts sending `send_bytes` of `send` to the next rank of the ring, (rank + 1) % size, and
  /// receiving `recv_bytes` into `recv` from the previous one; returns at once. Neither buffer
  /// may be touched until wait(). With one rank the bytes are copied. The sizes must match what
  /// the neighbour sends (every rank knows every shard's size).
  virtual std::unique_ptr<Transfer> start_shift(const void* send, std::size_t send_bytes,
                                                void* recv, std::size_t recv_bytes) = 0;
  /// Completes a transfer; throws emflow::Error (ErrorCode::device / io) if it failed.
  virtual void wait(Transfer& transfer) = 0;
  /// Lets a transfer progress while the caller computes (MPI moves large messages only inside
  /// its calls); cheap, never blocks.
  virtual void poll(Transfer&) {}

  /// values[i] = the sum over ranks of values[i], added in rank order (rank 0 first) so that
  /// every rank gets the same bits and a run is reproducible. Host memory.
  virtual void allreduce_sum(double* values, std::int64_t count) = 0;
  /// The same for integers (exact). Host memory.
  virtual void allreduce_sum(std::int64_t* values, std::int64_t count) = 0;
  /// values[i] = the minimum over ranks. Host memory.
  virtual void allreduce_min(std::int64_t* values, std::int64_t count) = 0;
  /// Copies `bytes` of `data` on `root` into `data` on every rank.
  virtual void broadcast(void* data, std::size_t bytes, int root) = 0;
  /// On `root`, `recv` receives the `counts[r]` bytes of every rank r one after another in rank
  /// order (counts: size() entries, the same on every rank); `recv` is unused elsewhere.
  virtual void gather(const void* send, void* recv, const std::vector<std::size_t>& counts,
                      int root) = 0;
};

/// The communicator of a process that runs alone: rank 0 of 1.
class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Memory memory() const override { return Memory::host; }
  std::unique_ptr<Transfer> start_shift(const void* send, std::size_t send_bytes, void* recv,
                                        std::size_t recv_bytes) override;
  void wait(Transfer& transfer) override;
  void allreduce_sum(double*, std::int64_t) override {}
  void allreduce_sum(std::int64_t*, std::int64_t) override {}
  void allreduce_min(std::int64_t*, std::int64_t) override {}
  void broadcast(void*, std::size_t, int root) override;
  void gather(const void* send, void* recv, const std::vector<std::size_t>& counts,
              int root) override;
};

/// What agree() throws: an error every rank of the job has and throws at the same point, so a
/// program may report it once (on rank 0) and end normally on every rank.
class AgreedError : public Error {
 public:
  using Error::Error;
};

/// Error agreement without a separate barrier: every rank calls agree() at the same point with
/// the exception it caught since the last agreement (or null). When no rank failed it returns.
/// Otherwise every rank throws AgreedError (an emflow::Error) with the code and message of the
/// lowest failing rank, the message prefixed "rank R: " when there is more than one rank, so every
/// rank stops at the same point with the same error and none waits for a partner that has given up.
/// Costs one integer allreduce, plus one broadcast when a rank failed. Host communicators only
/// need host memory for it; NCCL communicators use their stream.
void agree(Communicator& comm, const std::exception_ptr& local);

/// Runs `body` and agrees on its outcome (agree()): returns its result on every rank when it
/// succeeded everywhere, throws the same error on every rank otherwise.
template <class Body>
auto agreed(Communicator& comm, Body&& body) -> decltype(body()) {
  std::exception_ptr error;
  if constexpr (std::is_void_v<decltype(body())>) {
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
    agree(comm, error);
  } else {
    decltype(body()) result{};
    try {
      result = body();
    } catch (...) {
      error = std::current_exception();
    }
    agree(comm, error);
    return result;
  }
}

/// Is emflow built with the MPI communicator (distributed_mpi.hpp)? With NCCL?
bool built_with_mpi() noexcept;
bool built_with_nccl() noexcept;

/// A communicator over every process of an MPI job (MPI_COMM_WORLD), for programs that do not
/// use MPI themselves: initialises MPI (funneled threads) if needed and finalises it when the
/// returned object is destroyed, if it initialised it. Throws ErrorCode::unsupported when emflow
/// is built without MPI.
std::unique_ptr<Communicator> world(int* argc, char*** argv);

/// Ends every process of the job the world() communicator spans, with `code` (MPI_Abort): for an
/// error on one rank that the others cannot learn of by agreement. Without MPI: std::exit.
[[noreturn]] void abort_job(int code);

}  // namespace emflow::distributed
