// The progress bar that long runs of the emflow tool show on a terminal.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "emflow/flow.hpp"

namespace emflow::tools {

/// A one-line progress bar on stderr, drawn only when stderr is a terminal; at most ten
/// redraws a second. finish() clears the line.
class ProgressBar {
 public:
  explicit ProgressBar(std::string label);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  void update(std::int64_t done, std::int64_t total);
  void finish();
  /// A callback for the library's long runs; it refers to this bar, which must outlive it.
  flow::Progress callback();

 private:
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace emflow::tools
