// The unfused baseline that `emflow bench --baseline` and the CPU benchmarks hold the fused
// backend against: attention as numpy would write it, with BLAS products and the whole N x N
// matrix in memory (measured beside the fused path in docs/PERF.md):
//
//   R = X M,  C = X F^T,  S = R X^T (N x N, sgemm),  P = row softmax(S),  Delta += P C (sgemm)
//
// Only the tools link BLAS; the library itself does not depend on it. The softmax is the
// vectorised one of measure.hpp.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/attention.hpp"

namespace emflow::tools {

/// Buffers of the unfused baseline for one problem shape (the N x N matrix included).
class BlasBaseline {
 public:
  BlasBaseline(std::int64_t tokens, std::int64_t dim);

  /// Bytes this baseline holds (the N x N matrix dominates).
  std::int64_t bytes() const {
    return static_cast<std::int64_t>(
        4 * (relevance_gradients_.size() + content_.size() + scores_.size()));
  }

  /// The update of `input` (no key bias, offset or key lengths: the benchmark problems have
  /// none) on `threads` threads (0: the library defaults).
  void run(const AttentionInput<float>& input, float* update, int threads);

 private:
  std::vector<float> relevance_gradients_, content_, scores_;
};

}  // namespace emflow::tools
