#include "tools/blas_baseline.hpp"

#include <cblas.h>

#include "tools/measure.hpp"

// OpenBLAS's thread control; weak, so another BLAS links too (and keeps its own threading).
extern "C" void openblas_set_num_threads(int threads) __attribute__((weak));

namespace emflow::tools {

BlasBaseline::BlasBaseline(std::int64_t tokens, std::int64_t dim)
    : relevance_gradients_(static_cast<std::size_t>(tokens * dim)),
      content_(relevance_gradients_.size()),
      scores_(static_cast<std::size_t>(tokens * tokens)) {}

void BlasBaseline::run(const AttentionInput<float>& input, float* update, int threads) {
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
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, d, d, beta, X, d, M, d, 0.0f, R, d);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, d, d, 1.0f, X, d, F, d, 0.0f, C, d);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, d, 1.0f, R, d, X, d, 0.0f, S, N);
      softmax_rows(S, N, N, input.mask, threads);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, d, N, 1.0f, S, N, C, d,
                  h == 0 ? 0.0f : 1.0f, D, d);
    }
  }
}

}  // namespace emflow::tools
