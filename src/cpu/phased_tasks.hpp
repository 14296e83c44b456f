// Tasks of one OpenMP parallel region in phases, claimed in order from one counter: a task of
// phase p starts only when every task of phase needs[p] has finished, so one region holds a whole
// call (packing, then attention, batch after batch) with no barrier between the phases.
//
// A thread that has to wait (for a phase its next task needs, or, with no task left, for the
// others to finish) sleeps on a condition variable. It does not reach an OpenMP barrier before
// the work is done: libgomp spins there for up to about 300000 iterations (milliseconds) before
// it sleeps, and on a shared machine that spin takes the CPU time the thread it waits for needs.
// It spins a few tens of microseconds first, so that on a quiet machine a short wait costs no
// sleep and wake-up.
//
// No deadlock: tasks are claimed in order and needs[p] < p, so the earliest unfinished task has
// every task it needs finished, and its thread is running it, not waiting.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "target.hpp"

EMFLOW_CPU_BEGIN

class PhasedTasks {
 public:
  struct Task {
    int phase = -1;          ///< -1: no task left
    std::int64_t index = 0;  ///< within the phase
  };

  /// sizes[p] tasks in phase p; needs[p] is the phase p waits for (< p), or -1 for none.
  PhasedTasks(std::vector<std::int64_t> sizes, std::vector<int> needs)
      : sizes_(std::move(sizes)),
        needs_(std::move(needs)),
        done_(new std::atomic<std::int64_t>[sizes_.size()]) {
    for (std::size_t p = 0; p < sizes_.size(); ++p) {
      done_[p].store(0, std::memory_order_relaxed);
      first_.push_back(total_);
      total_ += sizes_[p];
    }
  }

  /// Claims the next task and waits until the phase it needs has finished.
  Task next() {
    const std::int64_t claimed = next_.fetch_add(1, std::memory_order_relaxed);
    if (claimed >= total_) return {};
    // The last phase starting at or before the task (empty phases share their successor's start).
    const int phase =
        static_cast<int>(std::upper_bound(first_.begin(), first_.end(), claimed) - first_.begin()) -
        1;
    const int need = needs_[static_cast<std::size_t>(phase)];
    if (need >= 0) wait(need);
    return {phase, claimed - first_[static_cast<std::size_t>(phase)]};
  }

  /// Marks a task finished (also one whose work failed, so that no thread waits forever).
  void finish(const Task& task) {
    const auto p = static_cast<std::size_t>(task.phase);
    if (done_[p].fetch_add(1, std::memory_order_acq_rel) + 1 == sizes_[p]) {
      // Under the lock, so a thread between its check and its sleep cannot miss the wake-up.
      std::lock_guard<std::mutex> lock(mutex_);
      finished_.notify_all();
    }
  }

  /// Waits until every task has finished; call when next() has no task left.
  void wait_all() {
    for (std::size_t p = 0; p < sizes_.size(); ++p) wait(static_cast<int>(p));
  }

 private:
  static constexpr int kSpins = 2000;  // some tens of microseconds

  bool complete(int phase) const {
    const auto p = static_cast<std::size_t>(phase);
    return done_[p].load(std::memory_order_acquire) == sizes_[p];
  }

  void wait(int phase) {
    // A short spin first: on a quiet machine the wait is often shorter than a sleep and a wake.
    for (int i = 0; i < kSpins; ++i) {
      if (complete(phase)) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return complete(phase); });
  }

  std::vector<std::int64_t> sizes_, first_;
  std::vector<int> needs_;
  std::unique_ptr<std::atomic<std::int64_t>[]> done_;
  std::int64_t total_ = 0;
  std::atomic<std::int64_t> next_{0};
  std::mutex mutex_;
  std::condition_variable finished_;
};

EMFLOW_CPU_END
