// Attention problems of the emflow tool and the benchmarks: the input of one layer over dense
// arrays, and the seeded float32 problem every CPU timing uses.
#pragma once

#include <cstdint>
#include <vector>

#include "emflow/attention.hpp"

namespace emflow::tools {

/// The input of one layer of `heads` heads over the dense row-major arrays of a cloud
/// (batch, tokens, dim) and its operators M and F (heads, dim, dim). Key bias, offset, beta, mask
/// and key lengths keep their defaults (none, none, 1, none, none).
template <class T>
AttentionInput<T> layer_input(const T* cloud, std::int64_t batch, std::int64_t tokens,
                              std::int64_t dim, std::int64_t heads, const T* relevance,
                              const T* content);

/// The seeded float32 problem every CPU timing uses (`emflow bench`, bench/cpu_attention.cpp):
/// a cloud uniform in [-1, 1]^d and operators scaled by 2 / sqrt(d), so softmax is not flat.
/// `input` points into the vectors, so a BenchProblem is neither copied nor moved.
struct BenchProblem {
  std::vector<float> cloud, relevance, content, update;
  AttentionInput<float> input;

  BenchProblem(std::int64_t batch, std::int64_t tokens, std::int64_t dim, std::int64_t heads,
               const Mask& mask);
  BenchProblem(const BenchProblem&) = delete;
  BenchProblem& operator=(const BenchProblem&) = delete;
};

extern template AttentionInput<float> layer_input<float>(const float*, std::int64_t, std::int64_t,
                                                         std::int64_t, std::int64_t, const float*,
                                                         const float*);
extern template AttentionInput<double> layer_input<double>(const double*, std::int64_t,
                                                           std::int64_t, std::int64_t, std::int64_t,
                                                           const double*, const double*);

}  // namespace emflow::tools
