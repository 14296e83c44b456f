// The one check of a requested CPU thread count, shared by every entry point that takes one
// (ExecutionOptions::threads of attend, attend_factored, attend_partial, the flow and the phase
// sweep; DecodeCache::attend's threads; the Python package) and the limit the CLI's --threads
// names. An OpenMP team of tens of thousands of threads does not start (libgomp crashes creating
// it), and beyond a few threads per core more only add overhead, so the count is refused above
// 4 per core, before any work.
#include <algorithm>
#include <thread>

#include "check.hpp"
#include "emflow/types.hpp"

namespace emflow {

namespace {
constexpr int kThreadsPerCore = 4;
constexpr int kUnknownCoresLimit = 1024;
}  // namespace

int max_threads() noexcept {
  static const int limit = [] {
    const unsigned cores = std::thread::hardware_concurrency();
    if (cores == 0) return kUnknownCoresLimit;
    return static_cast<int>(std::min(static_cast<unsigned>(kThreadsPerCore) * cores, 1u << 16));
  }();
  return limit;
}

int check_threads(std::int64_t threads, const char* operation) {
  if (threads < 0) {
    detail::fail_argument(operation, "threads", "must be >= 0 (0 chooses), got ", threads);
  }
  if (threads > max_threads()) {
    const unsigned cores = std::thread::hardware_concurrency();
    if (cores == 0) {
      detail::fail_argument(operation, "threads", "must be at most ", max_threads(),
                            " (the limit when the number of cores is unknown), got ", threads);
    }
    detail::fail_argument(operation, "threads", "must be at most ", max_threads(), " (",
                          kThreadsPerCore, " per core of the ", cores,
                          " cores of this machine; more threads only slow the call down), got ",
                          threads);
  }
  return static_cast<int>(threads);
}

}  // namespace emflow
