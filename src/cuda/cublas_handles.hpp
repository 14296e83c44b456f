// cuBLAS handles and errors for the CUDA backend: each host thread keeps one handle per device,
// reused by every call; cuBLAS itself is loaded on first use (cublas_loader.hpp).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "cublas_loader.hpp"

namespace emflow::detail {

/// Throws emflow::Error when `status` is not CUBLAS_STATUS_SUCCESS: "<operation>: <call> failed:
/// <why>" (ErrorCode::out_of_memory for allocation failures, ErrorCode::device otherwise).
void check_cublas(const CublasApi& api, cublasStatus_t status, const char* operation,
                  const char* call);

/// This thread's cuBLAS handle for `device` (which must be the current device), created on first
/// use or taken from the pool of handles that exited threads left, never destroyed; bound to
/// `stream` with cuBLAS's scratch memory pointed at `workspace`.
cublasHandle_t cublas_for_stream(const CublasApi& api, int device, cudaStream_t stream,
                                 void* workspace, std::size_t bytes, const char* operation);

/// One column-major strided-batched product in T (float or double) on `handle`, named `what` in
/// errors: C_i = alpha op(A_i) op(B_i) + beta C_i for i < count.
template <class T>
void gemm_strided_batched(const CublasApi& api, cublasHandle_t handle, cublasOperation_t a_op,
                          cublasOperation_t b_op, int m, int n, int k, const T* alpha, const T* a,
                          int lda, long long a_stride, const T* b, int ldb, long long b_stride,
                          const T* beta, T* c, int ldc, long long c_stride, int count,
                          const char* operation, const char* what) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "cuBLAS runs float, double");
  const auto function = [&] {
    if constexpr (std::is_same_v<T, float>) {
      return api.sgemm_strided_batched;
    } else {
      return api.dgemm_strided_batched;
    }
  }();
  check_cublas(api,
               function(handle, a_op, b_op, m, n, k, alpha, a, lda, a_stride, b, ldb, b_stride,
                        beta, c, ldc, c_stride, count),
               operation, what);
}

}  // namespace emflow::detail
