// The unfused baseline that `emflow bench --baseline` and the CPU benchmarks hold the fused
// backend against: attention as numpy would write it, with BLAS products and the whole N x N
// matrix in memory (REFERENCE.md §5):
//
//   R = X M,  C = X F^T,  S = R X^T (N x N, sgemm),  P = row softmax(S),  Delta += P C (sgemm)
//
// Header-only because it needs BLAS, which only the tools that time it link (the library
// itself does not depend on BLAS). The softmax is the library's vectorised one (measure.hpp).
#pragma once

#include <cblas.h>

#include <cstdint>
#include <vector>

#include "emflow/attention.hpp"
#include "measure.hpp"

// OpenBLAS's thread control; weak, so another BLAS links too (and keeps its own threading).
extern "C" void openblas_set_num_threads(int threads) __attribute__((weak));

namespace emflow::detail::cpu {

/// Buffers of the unfused baseline for one problem shape (the N x N matrix included).
class BlasBaseline {
 public:
  BlasBaseline(std::int64_t tokens, std::int64_t dim)
      : relevance_gradients_(static_cast<std::size_t>(tokens * dim)),
        content_(relevance_gradients_.size()),
        scores_(static_cast<std::size_t>(tokens * tokens)) {}

  /// Bytes this baseline holds (the N x N matrix dominates).
  std::int64_t bytes() const {
    return static_cast<std::int64_t>(
        4 * (relevance_gradients_.size() + content_.size() + scores_.size()));
  }

  /// The update of `input` (no key bias, offset or key lengths: the benchmark problems have
  /// none) on `threads` threads (0: the library defaults).
  void run(const AttentionInput<float>& input, float* update, int threads) {
    if (threads > 0) {
      if (openblas_set_num_threads) openblas_set_num_threads(threads);
    }
    const int N = static_cast<int>(input.tokens), d = static_cast<int>(input.dim);
    const float beta = static_cast<float>(input.beta);
    for (std::int64_t b = 0; b < input.batch; ++b) {
      const float* X = input.cloud + b * N * d;
      float* D = update + b * N * d;
      for (std::int64_t h = 0; h < input.layer.heads; ++h) {
        const float* M = input.layer.relevance + h * d * d;
        const float* F = input.layer.content + h * d * d;
        float* R = relevance_gradients_.data();
        float* C = content_.data();
        float* S = scores_.data();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, d, d, beta, X, d, M, d, 0.0f, R,
                    d);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, d, d, 1.0f, X, d, F, d, 0.0f, C, d);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, d, 1.0f, R, d, X, d, 0.0f, S, N);
        softmax_rows(S, N, N, input.mask, threads);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, d, N, 1.0f, S, N, C, d,
                    h == 0 ? 0.0f : 1.0f, D, d);
      }
    }
  }

 private:
  std::vector<float> relevance_gradients_, content_, scores_;
};

}  // namespace emflow::detail::cpu
