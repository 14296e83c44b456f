// Measuring tools for `emflow bench` and the CPU benchmarks, compiled with the CPU backend's
// flags so they use the same vector instructions: the machine's fp32 FMA rate and the row
// softmax of the unfused baseline.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "emflow/attention.hpp"
#include "emflow/types.hpp"

namespace emflow::detail::cpu {

/// The instruction set the CPU backend was compiled for ("avx512", "avx2+fma", ...).
const char* compiled_instruction_set();

/// Runs `iterations` steps of independent FMA chains (enough of them to hide the FMA latency,
/// so the loop is throughput-bound) on each of `threads` OpenMP threads (0: the default) and
/// returns the floating-point operations done (2 per lane per FMA). Time it to get the rate.
double fma_peak_work(int threads, std::int64_t iterations);

/// Softmax of each row of the rows x columns `scores` (row-major, in place) over the keys the
/// mask lets row i see (keys j with mask.allows(i, j)); weights of other keys become 0. Used by
/// the unfused baseline, which holds the whole N x N matrix. OpenMP over rows.
void softmax_rows(float* scores, std::int64_t rows, std::int64_t columns, const Mask& mask,
                  int threads);

/// The seeded float32 problem every CPU timing uses (`emflow bench`, bench/cpu_attention.cpp):
/// a cloud uniform in [-1, 1]^d and operators scaled by 2 / sqrt(d), so softmax is not flat.
/// `input` points into the vectors, so a BenchProblem is neither copied nor moved.
struct BenchProblem {
  std::vector<float> cloud, relevance, content, update;
  AttentionInput<float> input;

  BenchProblem(std::int64_t batch, std::int64_t tokens, std::int64_t dim, std::int64_t heads,
               const Mask& mask) {
    std::mt19937_64 engine(2024);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    const float scale = 2.0f / std::sqrt(static_cast<float>(dim));
    cloud.resize(static_cast<std::size_t>(batch * tokens * dim));
    relevance.resize(static_cast<std::size_t>(heads * dim * dim));
    content.resize(relevance.size());
    update.resize(cloud.size());
    for (float& v : cloud) v = unit(engine);
    for (float& v : relevance) v = scale * unit(engine);
    for (float& v : content) v = scale * unit(engine);
    input.cloud = cloud.data();
    input.batch = batch;
    input.tokens = tokens;
    input.dim = dim;
    input.layer.heads = heads;
    input.layer.relevance = relevance.data();
    input.layer.content = content.data();
    input.mask = mask;
  }
  BenchProblem(const BenchProblem&) = delete;
  BenchProblem& operator=(const BenchProblem&) = delete;
};

}  // namespace emflow::detail::cpu
