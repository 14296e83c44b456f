// An exception must not leave an OpenMP parallel region (the runtime terminates the process).
// ParallelErrors catches inside the region, keeps the first exception, lets the other
// iterations skip their work, and rethrows on the calling thread after the region.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>
#include <utility>

namespace emflow::detail {

class ParallelErrors {
 public:
  /// Runs `work` unless an earlier call failed; records the first exception it throws.
  template <class Work>
  void run(Work&& work) noexcept {
    if (failed()) return;
    try {
      std::forward<Work>(work)();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_) first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  bool failed() const noexcept { return failed_.load(std::memory_order_relaxed); }
  /// Call after the parallel region, on the thread that opened it.
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::mutex mutex_;
  std::exception_ptr first_;
  std::atomic<bool> failed_{false};
};

}  // namespace emflow::detail
