// emflow's tensor-core attention beside cuDNN's (Google Benchmark, CUDA-event timing).
//
//   emflow_bench_cuda --benchmark_filter=TensorCore
//
// BM_TensorCore times cuda::attend_factored_async (src/cuda/tc_factored.cpp: the projections, the
// tensor-core attention of kernels/tc_attention.cu and the output projection) in bf16 (bfloat16
// storage, m16n8k16) or tf32 (float storage, operands rounded to TF32, m16n8k8) on the shapes of
// BM_CudnnSdpa (bench/cuda_cudnn.cpp): N = 4k to 16k, head dim 64 and 128, B = max(1, 16384 / N)
// clouds, one head of rank r = d in a token space of dimension d, the causal mask or none, lse
// written. The FLOP count is the attention's, 4 B N^2 d (halved for the causal mask), as
// cuDNN's, so scripts/device-check.sh prints emflow bf16 / cuDNN bf16 per shape. emflow's time
// also holds the three input projections and the output projection (8 B N d^2, 2 d / N of the
// attention's FLOP: 3 % or less here), which cuDNN is not asked to do. The inputs are random
// (the speed does not depend on the values) and not rotated, as BM_CudnnSdpa's. Each iteration
// is one call on the benchmark's stream bracketed by CUDA events, after two warm-up calls.
// Without a device the benchmark is skipped with a message.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_timing.hpp"
#include "emflow/cuda.hpp"
#include "emflow/error.hpp"
#include "emflow/precision.hpp"

namespace {

using emflow::bench::random_device;
using emflow::cuda::DeviceBuffer;

constexpr std::int64_t kTokensPerCase = 16384;

template <class T>
void run_tensor_core(benchmark::State& state, emflow::Precision precision) {
  const std::int64_t n = state.range(0), d = state.range(1);
  const bool causal = state.range(2) != 0;
  const std::int64_t batch = std::max<std::int64_t>(1, kTokensPerCase / n);
  const auto size = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  try {
    emflow::bench::CudaTiming timing;
    const cudaStream_t stream = timing.stream();
    // Factors of order 1 / sqrt(d): projections of order one, scores of moderate spread.
    const float factor = 1.f / std::sqrt(static_cast<float>(d));
    DeviceBuffer<T> cloud = random_device<T>(size(batch * n * d), 1, 1.f, stream);
    DeviceBuffer<T> a = random_device<T>(size(d * d), 2, factor, stream);
    DeviceBuffer<T> b = random_device<T>(size(d * d), 3, factor, stream);
    DeviceBuffer<T> up = random_device<T>(size(d * d), 4, factor, stream);
    DeviceBuffer<T> down = random_device<T>(size(d * d), 5, factor, stream);
    DeviceBuffer<T> update(size(batch * n * d));
    DeviceBuffer<float> lse(size(batch * n));

    emflow::AttentionInput<T> input;
    input.cloud = cloud.data();
    input.batch = batch;
    input.tokens = n;
    input.dim = d;
    input.beta = 1.0 / std::sqrt(static_cast<double>(d));
    input.mask = causal ? emflow::Mask::causal() : emflow::Mask::none();
    const emflow::FactoredLayer<T> layer{1, d, a.data(), b.data(), up.data(), down.data()};
    emflow::AttentionOutput<T> output;
    output.update = update.data();
    output.lse = lse.data();
    const emflow::cuda::PlanOptions options{emflow::cuda::Algorithm::automatic, precision};
    const std::size_t bytes =
        emflow::cuda::attend_factored_workspace_size(input, layer, output, options);
    DeviceBuffer<unsigned char> workspace(bytes);
    const auto enqueue = [&] {
      emflow::cuda::attend_factored_async(input, layer, output, workspace.data(), bytes, stream,
                                          options);
    };
    if (emflow::bench::warmed_up(state, stream, enqueue)) {
      for (auto _ : state) {
        state.SetIterationTime(timing.seconds(enqueue));
      }
      const double full = 4.0 * static_cast<double>(batch) * static_cast<double>(n * n * d);
      state.counters["TFLOP/s"] = benchmark::Counter((causal ? full / 2 : full) * 1e-12,
                                                     benchmark::Counter::kIsIterationInvariantRate);
      state.counters["B"] = static_cast<double>(batch);
    }
  } catch (const emflow::Error& e) {
    state.SkipWithError(e.what());
  }
}

// range(3): 0 = bf16 (bfloat16 storage), 1 = tf32 (float storage).
void BM_TensorCore(benchmark::State& state) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    state.SkipWithError("no CUDA device");
    return;
  }
  if (state.range(3) == 0) {
    run_tensor_core<emflow::bfloat16>(state, emflow::Precision::bf16);
  } else {
    run_tensor_core<float>(state, emflow::Precision::tf32);
  }
}

void tensor_core_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t tf32 : {0, 1}) {
    for (std::int64_t causal : {0, 1}) {
      for (std::int64_t dim : {64, 128}) {
        for (std::int64_t tokens = 4096; tokens <= 16384; tokens *= 2) {
          b->Args({tokens, dim, causal, tf32});
        }
      }
    }
  }
  b->ArgNames({"N", "d", "causal", "tf32"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_TensorCore)->Apply(tensor_core_sizes);

}  // namespace
