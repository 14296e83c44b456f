// The single-process communicator and error agreement (emflow/distributed.hpp).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "check.hpp"
#include "emflow/distributed.hpp"
#include "emflow/error.hpp"

namespace emflow::distributed {

namespace {

struct Done final : Transfer {};

// The longest message agree() carries; longer ones are cut (they name the argument first).
constexpr std::size_t kMessageWords = 256;

struct Failure {
  ErrorCode code = ErrorCode::internal;
  std::string message;
};

Failure describe(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return {e.code(), e.what()};
  } catch (const std::bad_alloc&) {
    return {ErrorCode::out_of_memory, "out of memory"};
  } catch (const std::exception& e) {
    return {ErrorCode::internal, e.what()};
  } catch (...) {
    return {ErrorCode::internal, "unknown error"};
  }
}

}  // namespace

std::unique_ptr<Transfer> SingleProcess::start_shift(const void* send, std::size_t send_bytes,
                                                     void* recv, std::size_t recv_bytes) {
  if (send_bytes != recv_bytes) {
    detail::fail(ErrorCode::internal, "shift: one rank sends ", send_bytes, " bytes to itself, ",
                 "expected ", recv_bytes);
  }
  if (send_bytes > 0 && send != recv) std::memcpy(recv, send, send_bytes);
  return std::make_unique<Done>();
}

void SingleProcess::wait(Transfer&) {}

void SingleProcess::broadcast(void*, std::size_t, int root) {
  if (root != 0) detail::fail(ErrorCode::internal, "broadcast: root ", root, " of 1 rank");
}

void SingleProcess::gather(const void* send, void* recv, const std::vector<std::size_t>& counts,
                           int root) {
  if (root != 0 || counts.size() != 1) {
    detail::fail(ErrorCode::internal, "gather: root ", root, " and ", counts.size(),
                 " counts for 1 rank");
  }
  if (counts[0] > 0 && send != recv) std::memcpy(recv, send, counts[0]);
}

void agree(Communicator& comm, const std::exception_ptr& local) {
  const int ranks = comm.size();
  // The lowest failing rank, or `ranks` when none failed: one integer reduction.
  std::int64_t first = local ? comm.rank() : ranks;
  comm.allreduce_min(&first, 1);
  if (first == ranks) return;
  if (ranks == 1) {
    const Failure failure = describe(local);
    throw AgreedError(failure.code, failure.message);
  }
  // That rank's code and message, carried by an integer sum to which only it contributes (an
  // allreduce reaches every transport's host memory, a broadcast of host bytes not NCCL's).
  std::vector<std::int64_t> words(kMessageWords + 2, 0);
  if (comm.rank() == first) {
    const Failure failure = describe(local);
    const std::size_t length = std::min(failure.message.size(), kMessageWords * 8);
    words[0] = static_cast<std::int64_t>(failure.code);
    words[1] = static_cast<std::int64_t>(length);
    std::memcpy(words.data() + 2, failure.message.data(), length);
  }
  comm.allreduce_sum(words.data(), static_cast<std::int64_t>(words.size()));
  const std::size_t length =
      std::min(static_cast<std::size_t>(std::max<std::int64_t>(words[1], 0)), kMessageWords * 8);
  std::string message(length, '\0');
  std::memcpy(message.data(), words.data() + 2, length);
  throw AgreedError(static_cast<ErrorCode>(words[0]),
                    "rank " + std::to_string(first) + ": " + message);
}

bool built_with_mpi() noexcept {
#if EMFLOW_WITH_MPI
  return true;
#else
  return false;
#endif
}

bool built_with_nccl() noexcept {
#if EMFLOW_WITH_NCCL
  return true;
#else
  return false;
#endif
}

#if !EMFLOW_WITH_MPI
std::unique_ptr<Communicator> world(int*, char***) {
  detail::fail(ErrorCode::unsupported,
               "distributed: emflow was built without MPI (configure with MPI installed, "
               "EMFLOW_WITH_MPI=ON)");
}

void abort_job(int code) { std::exit(code); }
#endif

}  // namespace emflow::distributed
