// cuBLAS handles and errors for the CUDA backend: each host thread keeps one handle per device,
// reused by every call; cuBLAS itself is loaded on first use (cublas_loader.hpp).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>

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

}  // namespace emflow::detail
