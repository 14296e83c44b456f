// Device timing of enqueued work with CUDA events, for `emflow bench --device cuda` and the GPU
// benchmarks (bench/cuda_timing.hpp, which adds their warm-up and random inputs): one owner of a
// stream and its two events, released in every case, also when a check throws in between.
// Header-only, for a build with the CUDA runtime (EMFLOW_WITH_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <type_traits>

#include "emflow/error.hpp"

namespace emflow::tools {

/// A non-blocking stream and two events made together and destroyed together. Not copyable.
class CudaTiming {
 public:
  /// Throws emflow::Error (ErrorCode::device) naming the CUDA call that failed; what was made
  /// before it is released.
  CudaTiming() {
    cudaStream_t stream = nullptr;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    stream_.reset(stream);
    for (Event* event : {&start_, &stop_}) {
      cudaEvent_t made = nullptr;
      check(cudaEventCreate(&made), "cudaEventCreate");
      event->reset(made);
    }
  }

  /// The stream to enqueue the timed work on.
  cudaStream_t stream() const noexcept { return stream_.get(); }

  /// Device seconds of what `enqueue()` puts on stream(): an event before and one after, then a
  /// wait for the second. Throws emflow::Error (ErrorCode::device) naming a CUDA call that fails
  /// (also the error of the timed work itself, which the wait reports).
  template <class Enqueue>
  double seconds(Enqueue&& enqueue) {
    check(cudaEventRecord(start_.get(), stream()), "cudaEventRecord");
    enqueue();
    check(cudaEventRecord(stop_.get(), stream()), "cudaEventRecord");
    check(cudaEventSynchronize(stop_.get()), "cudaEventSynchronize");
    float milliseconds = 0.f;
    check(cudaEventElapsedTime(&milliseconds, start_.get(), stop_.get()), "cudaEventElapsedTime");
    return static_cast<double>(milliseconds) * 1e-3;
  }

 private:
  static void check(cudaError_t status, const char* call) {
    if (status != cudaSuccess) {
      throw Error(ErrorCode::device,
                  std::string("timing: ") + call + " failed: " + cudaGetErrorString(status));
    }
  }
  struct DestroyStream {
    void operator()(cudaStream_t stream) const noexcept { cudaStreamDestroy(stream); }
  };
  struct DestroyEvent {
    void operator()(cudaEvent_t event) const noexcept { cudaEventDestroy(event); }
  };
  using Stream = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, DestroyStream>;
  using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, DestroyEvent>;

  // Declared in this order so the events go before the stream they were recorded on.
  Stream stream_;
  Event start_, stop_;
};

}  // namespace emflow::tools
