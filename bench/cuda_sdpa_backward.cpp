// The SDPA-shaped operator's backward pass on the GPU, and its float forward (Google Benchmark,
// CUDA-event timing).
//
//   emflow_bench_cuda --benchmark_filter='SdpaBackward|SdpaForward'
//
// BM_SdpaBackward times cuda::sdpa_backward_async (src/cuda/sdpa_async.cpp: the row terms'
// kernel, then the backward kernels of kernels/sdpa_backward.cu) on the shapes of BM_TensorCore:
// N = 4k and 16k tokens, head dim 64 and 128, B = max(1, 16384 / N) clouds, one head, the causal
// mask or none. `mode`: 0 bf16 on the tensor cores, deterministic (dQ by its own kernel); 1 bf16
// with dQ by atomics (cuda::SdpaBackwardOptions); 2 float32 kernels, deterministic. The saved
// forward (output, lse) comes from cuda::sdpa_attend_async on the same inputs, once, untimed;
// dO is random. The FLOP count is FlashAttention's convention for the backward, 2.5 times the
// forward's 4 B N^2 d (five products against two; halved for the causal mask), so the figure
// reads against FlashAttention-2's and cuDNN's backward. Each iteration is one call on the
// benchmark's stream bracketed by CUDA events, after two warm-up calls. Without a device the
// benchmark is skipped with a message.
//
// BM_SdpaForward times cuda::sdpa_attend_async on the same shapes in float: `mode` 0 the float32
// kernel (Precision::fp32, kernels/sdpa_backward.cu), 1 the tensor cores in TF32 (tc_attention.cu);
// FLOP 4 B N^2 d, halved for the causal mask.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_timing.hpp"
#include "emflow/cuda.hpp"
#include "emflow/error.hpp"
#include "emflow/precision.hpp"
#include "emflow/sdpa.hpp"

namespace {

using emflow::bench::random_device;
using emflow::cuda::DeviceBuffer;

constexpr std::int64_t kTokensPerCase = 16384;

// The benchmarks' problem: `batch` clouds of one head, n queries and n keys of width d, scale
// 1/sqrt(d), the causal mask or none.
template <class T>
emflow::SdpaInput<T> one_head(const T* queries, const T* keys, const T* values, std::int64_t batch,
                              std::int64_t n, std::int64_t d, bool causal) {
  emflow::SdpaInput<T> input;
  input.queries = queries;
  input.keys = keys;
  input.values = values;
  input.batch = batch;
  input.query_heads = input.kv_heads = 1;
  input.query_tokens = input.tokens = n;
  input.rank = input.value_rank = d;
  input.scale = 1.0 / std::sqrt(static_cast<double>(d));
  input.mask = causal ? emflow::Mask::causal() : emflow::Mask::none();
  return input;
}

template <class T>
void run_backward(benchmark::State& state, bool deterministic) {
  const std::int64_t n = state.range(0), d = state.range(1);
  const bool causal = state.range(2) != 0;
  const std::int64_t batch = std::max<std::int64_t>(1, kTokensPerCase / n);
  const auto count = static_cast<std::size_t>(batch * n * d);
  const auto rows = static_cast<std::size_t>(batch * n);
  try {
    emflow::bench::CudaTiming timing;
    const cudaStream_t stream = timing.stream();
    DeviceBuffer<T> queries = random_device<T>(count, 1, 1.f, stream);
    DeviceBuffer<T> keys = random_device<T>(count, 2, 1.f, stream);
    DeviceBuffer<T> values = random_device<T>(count, 3, 1.f, stream);
    DeviceBuffer<T> output_gradient = random_device<T>(count, 4, 1.f, stream);
    DeviceBuffer<T> output(count), dq(count), dk(count), dv(count);
    DeviceBuffer<float> lse(rows);

    const emflow::SdpaInput<T> input =
        one_head<T>(queries.data(), keys.data(), values.data(), batch, n, d, causal);

    // The saved forward pass, once (float on the float32 kernel).
    const emflow::SdpaOutput<T> forward{output.data(), lse.data(), nullptr};
    const emflow::cuda::PlanOptions plan;  // float: Precision::fp32, the float32 kernel
    DeviceBuffer<unsigned char> forward_workspace(
        emflow::cuda::sdpa_workspace_size(input, forward, plan));
    emflow::cuda::sdpa_attend_async(input, forward, forward_workspace.data(),
                                    forward_workspace.size(), stream, plan);

    const emflow::SdpaSaved<T> saved{output.data(), lse.data(), nullptr};
    const emflow::UpstreamGradients<T> upstream{output_gradient.data(), nullptr, nullptr};
    const emflow::SdpaGradientOutput<T> gradients{dq.data(), dk.data(), dv.data(), nullptr};
    emflow::cuda::SdpaBackwardOptions options;
    options.deterministic = deterministic;
    const std::size_t bytes =
        emflow::cuda::sdpa_backward_workspace_size(input, upstream, gradients, options);
    DeviceBuffer<unsigned char> workspace(bytes);
    const auto enqueue = [&] {
      emflow::cuda::sdpa_backward_async(input, saved, upstream, gradients, workspace.data(), bytes,
                                        stream, options);
    };
    if (emflow::bench::warmed_up(state, stream, enqueue)) {
      for (auto _ : state) {
        state.SetIterationTime(timing.seconds(enqueue));
      }
      const double forward_flop = 4.0 * static_cast<double>(batch) * static_cast<double>(n * n * d);
      const double flop = 2.5 * (causal ? forward_flop / 2 : forward_flop);
      state.counters["TFLOP/s"] =
          benchmark::Counter(flop * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
      state.counters["B"] = static_cast<double>(batch);
    }
  } catch (const emflow::Error& e) {
    state.SkipWithError(e.what());
  }
}

void BM_SdpaBackward(benchmark::State& state) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    state.SkipWithError("no CUDA device");
    return;
  }
  switch (state.range(3)) {
    case 0:
      run_backward<emflow::bfloat16>(state, true);
      break;
    case 1:
      run_backward<emflow::bfloat16>(state, false);
      break;
    default:
      run_backward<float>(state, true);
      break;
  }
}

void BM_SdpaForward(benchmark::State& state) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const std::int64_t n = state.range(0), d = state.range(1);
  const bool causal = state.range(2) != 0;
  const std::int64_t batch = std::max<std::int64_t>(1, kTokensPerCase / n);
  const auto count = static_cast<std::size_t>(batch * n * d);
  try {
    emflow::bench::CudaTiming timing;
    const cudaStream_t stream = timing.stream();
    DeviceBuffer<float> queries = random_device<float>(count, 1, 1.f, stream);
    DeviceBuffer<float> keys = random_device<float>(count, 2, 1.f, stream);
    DeviceBuffer<float> values = random_device<float>(count, 3, 1.f, stream);
    DeviceBuffer<float> output(count), lse(static_cast<std::size_t>(batch * n));
    const emflow::SdpaInput<float> input =
        one_head<float>(queries.data(), keys.data(), values.data(), batch, n, d, causal);
    const emflow::SdpaOutput<float> out{output.data(), lse.data(), nullptr};
    emflow::cuda::PlanOptions options;
    if (state.range(3) == 1) options.precision = emflow::Precision::tf32;
    DeviceBuffer<unsigned char> workspace(emflow::cuda::sdpa_workspace_size(input, out, options));
    const auto enqueue = [&] {
      emflow::cuda::sdpa_attend_async(input, out, workspace.data(), workspace.size(), stream,
                                      options);
    };
    if (emflow::bench::warmed_up(state, stream, enqueue)) {
      for (auto _ : state) state.SetIterationTime(timing.seconds(enqueue));
      const double flop = 4.0 * static_cast<double>(batch) * static_cast<double>(n * n * d);
      state.counters["TFLOP/s"] = benchmark::Counter((causal ? flop / 2 : flop) * 1e-12,
                                                     benchmark::Counter::kIsIterationInvariantRate);
      state.counters["B"] = static_cast<double>(batch);
    }
  } catch (const emflow::Error& e) {
    state.SkipWithError(e.what());
  }
}

void forward_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t mode : {0, 1}) {
    for (std::int64_t causal : {0, 1}) {
      for (std::int64_t dim : {64, 128}) {
        for (std::int64_t tokens : {4096, 16384}) b->Args({tokens, dim, causal, mode});
      }
    }
  }
  b->ArgNames({"N", "d", "causal", "mode"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_SdpaForward)->Apply(forward_sizes);

void backward_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t mode : {0, 1, 2}) {
    for (std::int64_t causal : {0, 1}) {
      for (std::int64_t dim : {64, 128}) {
        for (std::int64_t tokens : {4096, 16384}) b->Args({tokens, dim, causal, mode});
      }
    }
  }
  b->ArgNames({"N", "d", "causal", "mode"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_SdpaBackward)->Apply(backward_sizes);

}  // namespace
