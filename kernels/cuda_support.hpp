// emflow's one error path for the CUDA runtime and cuBLAS: every failing call becomes an
// emflow::Error naming the operation and the call (ErrorCode::out_of_memory for allocation
// failures, ErrorCode::device otherwise), and RAII owners for the few handles the host code
// creates, so that no error path leaks.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace emflow::detail {

/// Throws emflow::Error when `status` is not cudaSuccess: "<operation>: <call> failed: <why>".
void check_cuda(cudaError_t status, const char* operation, const char* call);

/// The same for cuBLAS.
void check_cublas(cublasStatus_t status, const char* operation, const char* call);

/// Reports a failed kernel launch (bad configuration, too much shared memory) without waiting
/// for the kernel: cudaGetLastError after the launch. Entry points call check_no_pending_error
/// first, so an error found here is the launch's own.
void check_launch(const char* operation, const char* kernel);

/// Throws ErrorCode::device when a CUDA error is already recorded on entry (the caller's earlier
/// work), without consuming it, so that it is not reported later as a failure of emflow's own.
void check_no_pending_error(const char* operation);

/// An owned stream, non-blocking with respect to the legacy default stream.
class OwnedStream {
 public:
  explicit OwnedStream(const char* operation);
  ~OwnedStream();
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t get() const noexcept { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

/// This thread's cuBLAS handle for the current device (created on first use or taken from the
/// pool of handles that exited threads left; never destroyed), bound to `stream` with cuBLAS's
/// scratch memory pointed at `workspace`.
cublasHandle_t cublas_for_stream(cudaStream_t stream, void* workspace, std::size_t bytes,
                                 const char* operation);

}  // namespace emflow::detail
