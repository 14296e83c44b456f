// Google Benchmark: one decoding step of the factored decode cache (decode.hpp) for a
// SmolLM2-135M-sized layer (d = 576, 9 query heads sharing 3 kv heads, rank 64, rotary over all
// 64 dimensions with base 100000, float32): append one token (its keys projected and rotated
// once, its values projected) and attend it under the causal mask to a cache of L tokens, for
// L = 128, 1024, 4096. The cache is filled before the timed loop, and each iteration appends
// one more token, so a run of `iterations` steps covers lengths L .. L + iterations - 1 (the
// counter `length` is their mean; the iteration counts are fixed small for that). Counters:
//   tokens/s  decoding steps per second for this one layer
//   length    the mean cache length of the timed steps
//
//   emflow_bench_cpu --benchmark_filter=BM_decode_factored_rotary
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "emflow/decode.hpp"
#include "emflow/factored.hpp"

namespace {

constexpr std::int64_t kDim = 576, kHeads = 9, kKvHeads = 3, kRank = 64;

/// Reproducible values in [-scale, scale) (a linear congruential sequence).
std::vector<float> values(std::int64_t count, std::uint64_t seed, double scale) {
  std::vector<float> out(static_cast<std::size_t>(count));
  std::uint64_t x = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (float& v : out) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    v = static_cast<float>(scale * (static_cast<double>(x >> 11) * 0x1.0p-53 * 2.0 - 1.0));
  }
  return out;
}

void BM_decode_factored_rotary(benchmark::State& state) {
  const std::int64_t length = state.range(0), d = kDim, r = kRank;
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<float> A = values(kHeads * r * d, 1, s), B = values(kKvHeads * r * d, 2, s);
  const std::vector<float> U = values(kHeads * d * r, 3, s), V = values(kKvHeads * r * d, 4, s);
  emflow::FactoredLayer<float> layer;
  layer.heads = kHeads;
  layer.rank = r;
  layer.query_factor = A.data();
  layer.key_factor = B.data();
  layer.content_up = U.data();
  layer.content_down = V.data();
  layer.kv_heads = kKvHeads;
  layer.rotary.dim = r;
  layer.rotary.base = 100000.0;
  const std::int64_t steps = static_cast<std::int64_t>(state.max_iterations);
  const std::vector<float> cloud = values((length + steps) * d, 5, 1.0);
  emflow::DecodeCache cache(layer, d, 1.0 / std::sqrt(static_cast<double>(r)));
  cache.append(cloud.data(), length);
  std::vector<float> update(static_cast<std::size_t>(d));
  const emflow::AttentionOutput<float> out{update.data()};
  for (auto _ : state) {
    const float* token = cloud.data() + cache.size() * d;
    cache.append(token, 1);
    cache.attend(token, 1, emflow::Mask::causal(), out);
    benchmark::DoNotOptimize(update.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["length"] = static_cast<double>(length) + (static_cast<double>(steps) - 1) / 2;
}

BENCHMARK(BM_decode_factored_rotary)
    ->ArgName("L")
    ->Arg(128)
    ->Iterations(16)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_decode_factored_rotary)
    ->ArgName("L")
    ->Arg(1024)
    ->Iterations(64)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_decode_factored_rotary)
    ->ArgName("L")
    ->Arg(4096)
    ->Iterations(64)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
