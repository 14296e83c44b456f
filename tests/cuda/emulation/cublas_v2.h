// CPU emulation of the cuBLAS calls emflow makes (tests/cuda/emulation/run.sh): a plain
// column-major strided-batched GEMM with cuBLAS's argument checks and beta == 0 semantics. A
// handle belongs to the device current at cublasCreate (cuBLAS assumes it stays current): a stream
// of another device, or a call while another device is current, is refused.
#pragma once
#include "cuda_runtime.h"
struct cublasContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  std::size_t bytes = 0;
};
using cublasHandle_t = cublasContext*;
enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_EXECUTION_FAILED = 13
};
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasMath_t { CUBLAS_DEFAULT_MATH = 0 };
inline const char* cublasGetStatusString(cublasStatus_t) { return "emulated"; }
inline const char* cublasGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS_EMULATED"; }
inline cublasStatus_t cublasCreate(cublasHandle_t* h) {
  *h = new cublasContext;
  (*h)->device = emu::current_device;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasDestroy(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) {
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  if (s != nullptr && s->device != h->device) return CUBLAS_STATUS_INVALID_VALUE;
  h->stream = s;
  h->workspace = nullptr;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void* w, std::size_t b) {
  cudaPointerAttributes a;
  cudaPointerGetAttributes(&a, w);
  if (a.type != cudaMemoryTypeDevice || a.device != h->device ||
      reinterpret_cast<std::uintptr_t>(w) % 256)
    return CUBLAS_STATUS_INVALID_VALUE;
  h->workspace = w;
  h->bytes = b;
  return CUBLAS_STATUS_SUCCESS;
}
// Checks the arguments now, as cuBLAS does, and queues the product on the handle's stream (the
// scalars are read now: host pointer mode).
template <class T>
cublasStatus_t emu_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                        int k, const T* alpha_at, const T* A, int lda, long long sa, const T* B,
                        int ldb, long long sb, const T* beta_at, T* C, int ldc, long long sc,
                        int count) {
  if (m < 0 || n < 0 || k < 0 || count < 0) return CUBLAS_STATUS_INVALID_VALUE;
  // Its kernels would be launched on the current device, into the handle's stream.
  if (h->device != emu::current_device) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (lda < std::max(1, ta == CUBLAS_OP_N ? m : k)) return CUBLAS_STATUS_INVALID_VALUE;
  if (ldb < std::max(1, tb == CUBLAS_OP_N ? k : n)) return CUBLAS_STATUS_INVALID_VALUE;
  if (ldc < std::max(1, m)) return CUBLAS_STATUS_INVALID_VALUE;
  const T alpha = *alpha_at, beta = *beta_at;
  emu::enqueue(h->stream, [=] {
    for (int b = 0; b < count; ++b) {
      const T* a = A + b * sa;
      const T* bb = B + b * sb;
      T* c = C + b * sc;
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
          T acc = 0;
          if (alpha != T(0))
            for (int l = 0; l < k; ++l) {
              const T av =
                  ta == CUBLAS_OP_N ? a[i + (long long)l * lda] : a[l + (long long)i * lda];
              const T bv =
                  tb == CUBLAS_OP_N ? bb[l + (long long)j * ldb] : bb[j + (long long)l * ldb];
              acc += av * bv;
            }
          T value = alpha * acc;
          if (beta != T(0)) value += beta * c[i + (long long)j * ldc];
          c[i + (long long)j * ldc] = value;
        }
    }
    return true;
  });
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                                cublasOperation_t tb, int m, int n, int k,
                                                const float* alpha, const float* A, int lda,
                                                long long sa, const float* B, int ldb, long long sb,
                                                const float* beta, float* C, int ldc, long long sc,
                                                int count) {
  return emu_gemm(h, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, count);
}
inline cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                                cublasOperation_t tb, int m, int n, int k,
                                                const double* alpha, const double* A, int lda,
                                                long long sa, const double* B, int ldb,
                                                long long sb, const double* beta, double* C,
                                                int ldc, long long sc, int count) {
  return emu_gemm(h, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, count);
}
