// Google Benchmark: the fused CPU backend of emflow::attend (float32, one cloud, one head, no
// mask) at N = 1k..16k and d = 32, 64, 128, beside the unfused OpenBLAS baseline (sgemm, row
// softmax, an N x N matrix) at the same shapes up to N = 8k (a 256 MiB matrix; 16k would need
// 1 GiB), and the machine's fp32 FMA peak. Counters:
//   GFLOP/s  attention-equivalent 4 N^2 d per iteration (docs/MATH.md §2), as a rate
//   bytes    working memory the method holds beyond its inputs and outputs
//
//   emflow_bench_cpu --benchmark_filter='N:4096/d:64'
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "emflow/attention.hpp"
#include "tools/blas_baseline.hpp"
#include "tools/measure.hpp"
#include "tools/problem.hpp"

namespace {

// One cloud, one head, no mask: the problem `emflow bench` times.
struct Problem : emflow::tools::BenchProblem {
  Problem(std::int64_t tokens, std::int64_t dim)
      : BenchProblem(1, tokens, dim, 1, emflow::Mask::none()) {}
};

void set_counters(benchmark::State& state, std::int64_t tokens, std::int64_t dim, double bytes) {
  const double flop = 4.0 * static_cast<double>(tokens) * static_cast<double>(tokens) * dim;
  state.counters["GFLOP/s"] =
      benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes"] = bytes;
}

void BM_cpu_attend(benchmark::State& state) {
  const std::int64_t tokens = state.range(0), dim = state.range(1);
  Problem p(tokens, dim);
  const emflow::AttentionOutput<float> out{p.update.data(), nullptr, nullptr, nullptr};
  for (auto _ : state) {
    emflow::attend(p.input, out, {emflow::Device::cpu});
    benchmark::DoNotOptimize(p.update.data());
  }
  // Queries, keys and values of one head, rounded up to whole tiles of 64 tokens.
  const std::int64_t tiled_tokens = (tokens + 63) / 64 * 64;
  set_counters(state, tokens, dim, 3.0 * 4.0 * static_cast<double>(tiled_tokens * dim));
}

void BM_blas_unfused(benchmark::State& state) {
  const std::int64_t tokens = state.range(0), dim = state.range(1);
  Problem p(tokens, dim);
  emflow::tools::BlasBaseline baseline(tokens, dim);
  for (auto _ : state) {
    baseline.run(p.input, p.update.data(), 0);
    benchmark::DoNotOptimize(p.update.data());
  }
  set_counters(state, tokens, dim, static_cast<double>(baseline.bytes()));
}

void BM_fma_peak(benchmark::State& state) {
  double flop = 0.0;
  for (auto _ : state) flop = emflow::tools::fma_peak_work(0, 1 << 22);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(emflow::tools::compiled_instruction_set());
}

void shapes(benchmark::internal::Benchmark* b, std::int64_t max_tokens) {
  b->ArgNames({"N", "d"});
  for (std::int64_t d : {32, 64, 128}) {
    for (std::int64_t n = 1024; n <= max_tokens; n *= 2) b->Args({n, d});
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_cpu_attend)->Apply([](benchmark::internal::Benchmark* b) { shapes(b, 16384); });
BENCHMARK(BM_blas_unfused)->Apply([](benchmark::internal::Benchmark* b) { shapes(b, 8192); });
BENCHMARK(BM_fma_peak)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
