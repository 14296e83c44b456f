// What the GPU benchmarks (bench/cuda_*.cpp) share: the owned stream and events with the
// CUDA-event timing of one enqueued call (tools::CudaTiming, the timing `emflow bench` uses too),
// the untimed warm-up, and the random inputs.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "emflow/cuda.hpp"
#include "emflow/precision.hpp"
#include "tools/cuda_timing.hpp"

namespace emflow::bench {

// The stream and events of a timed benchmark, and the event timing of one enqueued call:
// timing.seconds(enqueue), device seconds (tools/cuda_timing.hpp, shared with `emflow bench`).
using tools::CudaTiming;

// Two untimed calls; false, with the benchmark marked as failed, when the device reports an
// error.
template <class Enqueue>
bool warmed_up(benchmark::State& state, cudaStream_t stream, Enqueue&& enqueue) {
  for (int warm = 0; warm < 2; ++warm) enqueue();
  if (cudaStreamSynchronize(stream) == cudaSuccess) return true;
  state.SkipWithError("the warm-up run failed on the device");
  return false;
}

// Uniform values in [-scale, scale) from a xorshift generator: fast enough for 10^8 values.
inline std::vector<float> random_values(std::size_t count, std::uint64_t seed, float scale) {
  std::vector<float> values(count);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& v : values) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    v = scale * (static_cast<float>(state >> 40) / static_cast<float>(1 << 24) * 2.f - 1.f);
  }
  return values;
}

// The values of random_values rounded to T (float, or a 16-bit storage type), on the host.
template <class T = float>
std::vector<T> random_stored(std::size_t count, std::uint64_t seed, float scale) {
  const std::vector<float> values = random_values(count, seed, scale);
  std::vector<T> host(count);
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (std::is_same_v<T, bfloat16>) {
      host[i] = to_bfloat16(values[i]);
    } else if constexpr (std::is_same_v<T, float16>) {
      host[i] = to_float16(values[i]);
    } else {
      host[i] = values[i];
    }
  }
  return host;
}

// random_stored's values on the device, copied on `stream` (which is synchronised: the host copy
// must outlive the transfer).
template <class T = float>
cuda::DeviceBuffer<T> random_device(std::size_t count, std::uint64_t seed, float scale,
                                    cudaStream_t stream) {
  const std::vector<T> host = random_stored<T>(count, seed, scale);
  cuda::DeviceBuffer<T> device(count);
  device.copy_from_host(host.data(), count, stream);
  cudaStreamSynchronize(stream);
  return device;
}

}  // namespace emflow::bench
