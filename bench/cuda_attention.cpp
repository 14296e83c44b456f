// GPU benchmarks of the EMF contextual update (Google Benchmark, CUDA-event timing).
//
//   emflow_bench_cuda [--benchmark_min_time=0.1s] [--benchmark_filter=Fused]
//
// For N from 1k to 32k tokens, d = 64 and 128, with and without the causal mask:
//   BM_Fused            attend_async with Algorithm::fused (projections + fused kernel + sum)
//   BM_Unfused          attend_async with Algorithm::unfused (projections, S = R X^T, softmax, P C)
//   BM_FusedBf16        attend_async on bfloat16 storage: the dense form on the tensor cores
//                       (projections rounded to bf16, mma.sync attention per head, fp32 sum)
//   BM_CublasProducts   the two N x N products of the unfused path alone (S = R X^T and P C),
//                       cuBLAS sgemm: the floor of any unfused implementation
//   BM_Decode           one query (cross-attention, causal, aligned bottom-right) against N =
//                       4k..128k keys at d = 128, one cloud and one head: attend_async with the
//                       automatic algorithm, which splits the keys over the device
//                       (flash-decoding); see kv_bytes_per_second below
// Batch B = max(1, 16384 / N) clouds of one head, so every case holds 16k tokens (the
// convention of the FlashAttention benchmarks). Each timed iteration is bracketed by CUDA events
// on the benchmark's stream after two warm-up calls; the input cloud rotates over enough copies
// (at least 2, up to 8, about 256 MiB in all) that L2 (50 MB on an H200) does not hold the inputs
// from the previous iteration.
//
// Counters:
//   TFLOP/s       attention-equivalent: 4 B H N^2 d per call, halved for the causal mask
//                 (docs/MATH.md §2); the projections R = X M, C = X F^T are not in it
//   proj_TFLOP/s  the projections alone: 4 B H N d^2 per call
//   bytes_per_second  the device-memory traffic the algorithm cannot avoid: clouds, projections
//                 and update once each, plus for the unfused path the N x N scores written, read
//                 and rewritten by the softmax and read by the P C product (4 passes)
//   kv_bytes_per_second  BM_Decode only: the keys and contents the attention must read (2 N d
//                 floats) over the whole call's time. The call also forms C = X F^T (the API
//                 takes the cloud, not a cache of contents), so this understates the attention
//                 kernel's own bandwidth; the target is 50 % of the HBM bandwidth (H200:
//                 4.8 TB/s, so 2.4e12 here).
// Without a device the program prints why and exits with status 0.
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_timing.hpp"
#include "emflow/cuda.hpp"
#include "emflow/error.hpp"
#include "emflow/precision.hpp"
#include "tools/problem.hpp"

namespace {

using emflow::bench::CudaTiming;
using emflow::bench::random_device;
using emflow::bench::warmed_up;
using emflow::cuda::Algorithm;
using emflow::cuda::DeviceBuffer;

constexpr std::int64_t kTokensPerCase = 16384;
constexpr std::size_t kRotationBytes = std::size_t{256} << 20;

struct Shape {
  std::int64_t tokens, dim, batch, heads = 1;
  bool causal;
  explicit Shape(const benchmark::State& state)
      : tokens(state.range(0)),
        dim(state.range(1)),
        batch(std::max<std::int64_t>(1, kTokensPerCase / state.range(0))),
        causal(state.range(2) != 0) {}
  double attention_flop() const {
    const double full = 4.0 * batch * heads * static_cast<double>(tokens) * tokens * dim;
    return causal ? full / 2 : full;
  }
  double projection_flop() const { return 4.0 * batch * heads * tokens * dim * dim; }
  std::size_t cloud_size() const { return static_cast<std::size_t>(batch * tokens * dim); }
};

void set_counters(benchmark::State& state, const Shape& shape, double bytes) {
  state.counters["TFLOP/s"] = benchmark::Counter(shape.attention_flop() * 1e-12,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["proj_TFLOP/s"] = benchmark::Counter(
      shape.projection_flop() * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["B"] = static_cast<double>(shape.batch);
}

template <class T = float>
void run_attention(benchmark::State& state, Algorithm algorithm) {
  const Shape shape(state);
  try {
    CudaTiming timing;
    const cudaStream_t stream = timing.stream();
    const std::size_t cloud_bytes = shape.cloud_size() * sizeof(T);
    const std::size_t copies = std::clamp<std::size_t>(kRotationBytes / cloud_bytes, 2, 8);
    std::vector<DeviceBuffer<T>> clouds;
    clouds.reserve(copies);
    for (std::size_t c = 0; c < copies; ++c) {
      clouds.push_back(random_device<T>(shape.cloud_size(), 1 + c, 1.f, stream));
    }
    const auto operator_size = static_cast<std::size_t>(shape.heads * shape.dim * shape.dim);
    const float operator_scale = 2.f / std::sqrt(static_cast<float>(shape.dim));
    DeviceBuffer<T> relevance = random_device<T>(operator_size, 101, operator_scale, stream);
    DeviceBuffer<T> content = random_device<T>(operator_size, 102, operator_scale, stream);
    DeviceBuffer<T> update(shape.cloud_size());

    emflow::AttentionInput<T> input;
    input.cloud = clouds[0].data();
    input.batch = shape.batch;
    input.tokens = shape.tokens;
    input.dim = shape.dim;
    input.layer = {shape.heads, relevance.data(), content.data()};
    input.mask = shape.causal ? emflow::Mask::causal() : emflow::Mask::none();
    emflow::AttentionOutput<T> output;
    output.update = update.data();

    const std::size_t bytes = emflow::cuda::attend_workspace_size(input, output, {algorithm});
    DeviceBuffer<unsigned char> workspace(bytes);
    auto enqueue = [&] {
      emflow::cuda::attend_async(input, output, workspace.data(), bytes, stream, {algorithm});
    };
    if (!warmed_up(state, stream, enqueue)) return;
    std::size_t turn = 0;
    for (auto _ : state) {
      input.cloud = clouds[++turn % copies].data();
      state.SetIterationTime(timing.seconds(enqueue));
    }
    const double per_head = static_cast<double>(shape.cloud_size()) * sizeof(T);
    double traffic = per_head * (2 + 2 * shape.heads);  // clouds + update, projections
    if (algorithm == Algorithm::unfused) {
      traffic += 4.0 * shape.batch * shape.heads * static_cast<double>(shape.tokens) *
                 shape.tokens * sizeof(float);
    }
    set_counters(state, shape, traffic);
  } catch (const emflow::Error& e) {
    state.SkipWithError(e.what());
  }
}

void BM_Fused(benchmark::State& state) { run_attention(state, Algorithm::fused); }
void BM_Unfused(benchmark::State& state) { run_attention(state, Algorithm::unfused); }
void BM_FusedBf16(benchmark::State& state) {
  run_attention<emflow::bfloat16>(state, Algorithm::fused);
}

// S = R X^T and Delta = P C with cuBLAS for every cloud, as the unfused path issues them.
void BM_CublasProducts(benchmark::State& state) {
  const Shape shape(state);
  try {
    CudaTiming timing;
    const cudaStream_t stream = timing.stream();
    const int N = static_cast<int>(shape.tokens), d = static_cast<int>(shape.dim);
    const int B = static_cast<int>(shape.batch);
    const long long square = static_cast<long long>(N) * N, stride = static_cast<long long>(N) * d;
    const std::size_t copies =
        std::clamp<std::size_t>(kRotationBytes / (shape.cloud_size() * sizeof(float)), 2, 8);
    std::vector<DeviceBuffer<float>> clouds;
    clouds.reserve(copies);
    for (std::size_t c = 0; c < copies; ++c) {
      clouds.push_back(random_device(shape.cloud_size(), 1 + c, 1.f, stream));
    }
    DeviceBuffer<float> relevance = random_device(shape.cloud_size(), 201, 1.f, stream);
    DeviceBuffer<float> content = random_device(shape.cloud_size(), 202, 1.f, stream);
    DeviceBuffer<float> scores(static_cast<std::size_t>(square) * B);
    DeviceBuffer<float> update(shape.cloud_size());
    cublasHandle_t handle = nullptr;
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
      state.SkipWithError("cublasCreate failed");
      return;
    }
    cublasSetStream(handle, stream);
    const float one = 1.f, zero = 0.f;
    std::size_t turn = 0;
    auto enqueue = [&] {
      const float* cloud = clouds[turn % copies].data();
      cublasSgemmStridedBatched(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, N, d, &one, cloud, d, stride,
                                relevance.data(), d, stride, &zero, scores.data(), N, square, B);
      cublasSgemmStridedBatched(handle, CUBLAS_OP_N, CUBLAS_OP_N, d, N, N, &one, content.data(), d,
                                stride, scores.data(), N, square, &zero, update.data(), d, stride,
                                B);
    };
    for (int warm = 0; warm < 2; ++warm) enqueue();
    cudaStreamSynchronize(stream);
    for (auto _ : state) {
      ++turn;
      state.SetIterationTime(timing.seconds(enqueue));
    }
    cublasDestroy(handle);
    set_counters(state, shape,
                 static_cast<double>(shape.cloud_size()) * sizeof(float) * 4 +
                     2.0 * B * static_cast<double>(square) * sizeof(float));
  } catch (const emflow::Error& e) {
    state.SkipWithError(e.what());
  }
}

// One query against `tokens` keys: the decoding step of a growing cloud.
void BM_Decode(benchmark::State& state) {
  const std::int64_t tokens = state.range(0), dim = state.range(1);
  try {
    CudaTiming timing;
    const cudaStream_t stream = timing.stream();
    const auto keys = static_cast<std::size_t>(tokens * dim);
    std::vector<DeviceBuffer<float>> clouds;  // two copies: L2 never holds the last call's keys
    clouds.reserve(2);
    for (std::uint64_t c = 0; c < 2; ++c) clouds.push_back(random_device(keys, 1 + c, 1.f, stream));
    const auto operator_size = static_cast<std::size_t>(dim * dim);
    const float operator_scale = 2.f / std::sqrt(static_cast<float>(dim));
    DeviceBuffer<float> relevance = random_device(operator_size, 101, operator_scale, stream);
    DeviceBuffer<float> content = random_device(operator_size, 102, operator_scale, stream);
    DeviceBuffer<float> query = random_device(static_cast<std::size_t>(dim), 103, 1.f, stream);
    DeviceBuffer<float> update(static_cast<std::size_t>(dim));

    emflow::AttentionInput<float> input = emflow::tools::layer_input(
        clouds[0].data(), 1, tokens, dim, 1, relevance.data(), content.data());
    input.queries = query.data();
    input.query_tokens = 1;
    input.mask = emflow::Mask::causal();
    emflow::AttentionOutput<float> output;
    output.update = update.data();

    const std::size_t bytes = emflow::cuda::attend_workspace_size(input, output);
    DeviceBuffer<unsigned char> workspace(bytes);
    auto enqueue = [&] {
      emflow::cuda::attend_async(input, output, workspace.data(), bytes, stream);
    };
    if (!warmed_up(state, stream, enqueue)) return;
    std::size_t turn = 0;
    for (auto _ : state) {
      input.cloud = clouds[++turn % 2].data();
      state.SetIterationTime(timing.seconds(enqueue));
    }
    const double kv_bytes = 2.0 * static_cast<double>(keys) * sizeof(float);
    state.counters["kv_bytes_per_second"] =
        benchmark::Counter(kv_bytes, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["kv_HBM_fraction_H200"] =
        benchmark::Counter(kv_bytes / 4.8e12, benchmark::Counter::kIsIterationInvariantRate);
  } catch (const emflow::Error& e) {
    state.SkipWithError(e.what());
  }
}

void attention_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t causal : {0, 1}) {
    for (std::int64_t dim : {64, 128}) {
      for (std::int64_t tokens = 1024; tokens <= 32768; tokens *= 2) b->Args({tokens, dim, causal});
    }
  }
  b->ArgNames({"N", "d", "causal"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

void product_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t dim : {64, 128}) {
    for (std::int64_t tokens = 1024; tokens <= 32768; tokens *= 2) b->Args({tokens, dim, 0});
  }
  b->ArgNames({"N", "d", "causal"})->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Fused)->Apply(attention_sizes);
BENCHMARK(BM_Unfused)->Apply(attention_sizes);
BENCHMARK(BM_FusedBf16)->Apply(attention_sizes);
BENCHMARK(BM_CublasProducts)->Apply(product_sizes);
BENCHMARK(BM_Decode)
    ->ArgNames({"N", "d"})
    ->Args({4096, 128})
    ->Args({32768, 128})
    ->Args({131072, 128})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  std::string reason;
  if (!emflow::cuda::device_available(&reason)) {
    std::printf("emflow_bench_cuda: no CUDA device (%s); nothing to measure\n", reason.c_str());
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
