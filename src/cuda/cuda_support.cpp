// The CUDA runtime's error path (cuda_support.hpp) and the small public helpers of cuda.hpp:
// device_available and the device memory of DeviceBuffer.
#include "cuda_support.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/backends.hpp"
#include "core/check.hpp"
#include "emflow/cuda.hpp"
#include "plan_strategy.hpp"

namespace emflow::detail {

namespace {

ErrorCode code_of(cudaError_t status) {
  return status == cudaErrorMemoryAllocation ? ErrorCode::out_of_memory : ErrorCode::device;
}

}  // namespace

void check_cuda(cudaError_t status, const char* operation, const char* call) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // a failed call also records itself as the last error: clear it
  fail(code_of(status), operation, ": ", call, " failed: ", cudaGetErrorString(status), " (",
       cudaGetErrorName(status), ")");
}

void check_launch(const char* operation, const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return;
  fail(code_of(status), operation, ": launch of ", kernel, " failed: ", cudaGetErrorString(status),
       " (", cudaGetErrorName(status), ")");
}

void check_no_pending_error(const char* operation) {
  // Peek, not get: the error belongs to the caller's earlier work, so it stays recorded for them.
  const cudaError_t status = cudaPeekAtLastError();
  if (status == cudaSuccess) return;
  fail(ErrorCode::device, operation,
       ": a CUDA error was already pending before this call (left by ",
       "earlier work, not by emflow): ", cudaGetErrorString(status), " (", cudaGetErrorName(status),
       "); consume it with cudaGetLastError() before calling emflow");
}

OwnedStream::OwnedStream(const char* operation) {
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), operation,
             "cudaStreamCreateWithFlags");
}

OwnedStream::~OwnedStream() {
  // Work still queued completes before the stream's resources are released.
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

PinnedBuffer::PinnedBuffer(std::size_t bytes, const char* operation) : bytes_(bytes) {
  if (bytes == 0) return;
  check_cuda(cudaMallocHost(&data_, bytes), operation, "cudaMallocHost");
}

PinnedBuffer::~PinnedBuffer() {
  // cudaFreeHost waits for the device, so no queued copy still uses the memory.
  if (data_ != nullptr) cudaFreeHost(data_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

OwnedEvent::OwnedEvent(const char* operation) : operation_(operation) {
  check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), operation,
             "cudaEventCreateWithFlags");
}

OwnedEvent::~OwnedEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

void OwnedEvent::record(cudaStream_t stream) {
  check_cuda(cudaEventRecord(event_, stream), operation_, "cudaEventRecord");
  recorded_ = true;
}

void OwnedEvent::wait() {
  if (!recorded_) return;
  check_cuda(cudaEventSynchronize(event_), operation_, "cudaEventSynchronize");
  recorded_ = false;
}

// A pointer the kernels will dereference must be reachable from the current device.
void expect_device_pointer(const char* operation, const char* argument, const void* pointer,
                           int device) {
  if (pointer == nullptr) return;
  cudaPointerAttributes attributes{};
  check_cuda(cudaPointerGetAttributes(&attributes, pointer), operation, "cudaPointerGetAttributes");
  if (attributes.type == cudaMemoryTypeUnregistered) {
    fail_argument(operation, argument,
                  "must be device memory (cudaMalloc, managed or registered host memory), got an "
                  "ordinary host pointer");
  }
  if (attributes.type == cudaMemoryTypeDevice && attributes.device != device) {
    fail_argument(operation, argument, "is memory of device ", attributes.device,
                  ", but the current device is ", device);
  }
}

void expect_workspace(const char* operation, const void* workspace, std::size_t bytes,
                      std::size_t needed, int device) {
  if (workspace == nullptr && needed == 0) return;
  if (workspace == nullptr) fail_argument(operation, "workspace", "must not be null");
  expect_device_pointer(operation, "workspace", workspace, device);
  if (bytes < needed) {
    fail_argument(operation, "workspace_bytes", "must be >= ", needed,
                  " (the workspace size function), got ", bytes);
  }
  if (reinterpret_cast<std::uintptr_t>(workspace) % kWorkspaceAlignment != 0) {
    fail_argument(operation, "workspace", "must be aligned to ", kWorkspaceAlignment,
                  " bytes, got address ", workspace);
  }
}

// The device of an element-wise call: one must be usable, with no error pending.
int current_device(const char* operation) {
  std::string reason;
  if (!cuda_device_available(&reason)) {
    fail(ErrorCode::unsupported, operation, ": no usable CUDA device: ", reason);
  }
  check_no_pending_error(operation);
  int device = 0;
  check_cuda(cudaGetDevice(&device), operation, "cudaGetDevice");
  return device;
}

DeviceGuard::DeviceGuard(int device, const char* operation) {
  int current = 0;
  check_cuda(cudaGetDevice(&current), operation, "cudaGetDevice");
  if (current == device) return;
  check_cuda(cudaSetDevice(device), operation, "cudaSetDevice");
  previous_ = current;
}

DeviceGuard::~DeviceGuard() {
  // The caller's device was current a moment ago: setting it back cannot reasonably fail, and a
  // destructor could not report it.
  if (previous_ >= 0) cudaSetDevice(previous_);
}

void expect_stream_of(const char* operation, cudaStream_t stream, int device) {
  if (stream == nullptr) return;
  int owner = 0;
  check_cuda(cudaStreamGetDevice(stream, &owner), operation, "cudaStreamGetDevice");
  if (owner != device) {
    fail_argument(operation, "stream", "belongs to device ", owner,
                  ", but the plan was made on device ", device);
  }
}

}  // namespace emflow::detail

namespace emflow::cuda {

bool device_available(std::string* reason) noexcept {
  try {
    std::string why;
    const bool available = emflow::detail::cuda_device_available(&why);
    if (reason != nullptr) *reason = why;
    return available;
  } catch (...) {
    return false;
  }
}

namespace detail {

void* device_allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* pointer = nullptr;
  const cudaError_t status = cudaMalloc(&pointer, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    emflow::detail::fail(emflow::detail::code_of(status), "DeviceBuffer: cudaMalloc of ", bytes,
                         " bytes failed: ", cudaGetErrorString(status), " (",
                         cudaGetErrorName(status), ")");
  }
  return pointer;
}

void device_free(void* pointer) noexcept {
  if (pointer != nullptr) cudaFree(pointer);
}

void copy_host_to_device(void* device, const void* host, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  emflow::detail::check_cuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream),
                             "DeviceBuffer", "cudaMemcpyAsync (host to device)");
}

void copy_device_to_host(void* host, const void* device, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  emflow::detail::check_cuda(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream),
                             "DeviceBuffer", "cudaMemcpyAsync (device to host)");
}

void check_copy_count(std::size_t count, std::size_t size) {
  if (count > size) {
    emflow::detail::fail_argument("DeviceBuffer", "count", "must be <= the buffer's size ", size,
                                  ", got ", count);
  }
}

}  // namespace detail
}  // namespace emflow::cuda
