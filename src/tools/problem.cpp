#include "tools/problem.hpp"

#include <cmath>
#include <random>

namespace emflow::tools {

template <class T>
AttentionInput<T> layer_input(const T* cloud, std::int64_t batch, std::int64_t tokens,
                              std::int64_t dim, std::int64_t heads, const T* relevance,
                              const T* content) {
  AttentionInput<T> input;
  input.cloud = cloud;
  input.batch = batch;
  input.tokens = tokens;
  input.dim = dim;
  input.layer.heads = heads;
  input.layer.relevance = relevance;
  input.layer.content = content;
  return input;
}

template AttentionInput<float> layer_input<float>(const float*, std::int64_t, std::int64_t,
                                                  std::int64_t, std::int64_t, const float*,
                                                  const float*);
template AttentionInput<double> layer_input<double>(const double*, std::int64_t, std::int64_t,
                                                    std::int64_t, std::int64_t, const double*,
                                                    const double*);

BenchProblem::BenchProblem(std::int64_t batch, std::int64_t tokens, std::int64_t dim,
                           std::int64_t heads, const Mask& mask) {
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
  input = layer_input(cloud.data(), batch, tokens, dim, heads, relevance.data(), content.data());
  input.mask = mask;
}

}  // namespace emflow::tools
