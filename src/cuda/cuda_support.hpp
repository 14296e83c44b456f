// emflow's one error path for the CUDA runtime: every failing call becomes an emflow::Error
// naming the operation and the call (ErrorCode::out_of_memory for allocation failures,
// ErrorCode::device otherwise), and RAII owners for the few handles the host code creates, so
// that no error path leaks. cuBLAS has its own in cublas_handles.hpp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

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

/// Refuses (invalid_argument) a non-null pointer that `device`, the current device, cannot
/// dereference: ordinary host memory, or memory of another device.
void expect_device_pointer(const char* operation, const char* argument, const void* pointer,
                           int device);

/// Refuses a null, host, too small (`bytes` < `needed`) or misaligned workspace; a call that
/// needs none (`needed` 0) may pass null.
void expect_workspace(const char* operation, const void* workspace, std::size_t bytes,
                      std::size_t needed, int device);

/// The device of a stream-ordered call: one must be usable (else unsupported), with no error
/// pending.
int current_device(const char* operation);

/// Makes `device` current for the guard's lifetime (cudaSetDevice, only when another device is
/// current) and the caller's device current again when it ends: the device binding of a plan or
/// a decode cache, whose memory and kernel attributes belong to one device.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* operation);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  // the caller's device, when it had to be changed
};

/// Refuses (invalid_argument) a stream that belongs to another device than `device`, the
/// current one; nullptr, the current device's legacy default stream, always belongs to it.
void expect_stream_of(const char* operation, cudaStream_t stream, int device);

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

/// Page-locked host memory (cudaMallocHost): a copy to or from it is a DMA of its own, queued
/// without the stream being drained, and it stays valid until the copy has run.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(std::size_t bytes, const char* operation);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// An owned event without timing: marks a point of a stream the host can wait for.
class OwnedEvent {
 public:
  explicit OwnedEvent(const char* operation);
  ~OwnedEvent();
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
  /// Marks the work queued on `stream` so far.
  void record(cudaStream_t stream);
  /// Waits until the marked work has completed; nothing when never recorded.
  void wait();

 private:
  const char* operation_;
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
};

}  // namespace emflow::detail
