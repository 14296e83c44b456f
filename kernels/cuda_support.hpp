// emflow's one error path for the CUDA runtime: every failing call becomes an emflow::Error
// naming the operation and the call (ErrorCode::out_of_memory for allocation failures,
// ErrorCode::device otherwise), and RAII owners for the few handles the host code creates, so
// that no error path leaks. cuBLAS has its own in cublas_handles.hpp.
#pragma once

#include <cuda_runtime.h>

namespace emflow::detail {

/// Throws emflow::Error when `status` is not cudaSuccess: "<operation>: <call> failed: <why>".
void check_cuda(cudaError_t status, const char* operation, const char* call);

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

}  // namespace emflow::detail
