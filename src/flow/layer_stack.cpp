// The layers of a run from where their operators come from (generated or given arrays, seeded),
// the way `emflow flow` builds them from --m, --f and --seed, so that a run of the tool can be
// repeated from C++.
#include <algorithm>

#include "core/check.hpp"
#include "emflow/flow.hpp"
#include "emflow/mha.hpp"

namespace emflow::flow {

namespace {

using emflow::detail::fail;

// What an operator's array fixes: layers (0: one for all) and heads (0: not fixed).
struct Extent {
  std::int64_t layers = 0, heads = 0;
};

template <class T>
Extent extent_of(const OperatorSource<T>& source, std::int64_t dim, std::int64_t layer_count) {
  Extent e;
  if (source.array.size() == 0) return e;
  const Shape& shape = source.array.shape();
  const std::int64_t rank = source.array.rank();
  if (rank < 2 || rank > 4 || shape[static_cast<std::size_t>(rank - 1)] != dim ||
      shape[static_cast<std::size_t>(rank - 2)] != dim) {
    fail(ErrorCode::invalid_argument, source.name, " has shape ", emflow::to_string(shape),
         ", expected (", dim, ", ", dim, "), (H, ", dim, ", ", dim, ") or (L, H, ", dim, ", ", dim,
         ") (d = ", dim, ")");
  }
  e.heads = rank >= 3 ? shape[static_cast<std::size_t>(rank - 3)] : 1;
  e.layers = rank == 4 ? shape[0] : 0;
  if (rank == 4 && e.layers != layer_count) {
    fail(ErrorCode::invalid_argument, source.name, " holds ", e.layers, " layers, expected ",
         layer_count, " (one per layer of the stack)");
  }
  return e;
}

}  // namespace

template <class T>
std::vector<FlowLayer<T>> layer_stack(const OperatorSource<T>& relevance,
                                      const OperatorSource<T>& content, std::int64_t dim,
                                      std::int64_t layer_count, std::uint64_t seed) {
  emflow::detail::expect_positive("layer_stack", "dim", dim);
  emflow::detail::expect_positive("layer_stack", "layer_count", layer_count);
  const OperatorSource<T>* sources[2] = {&relevance, &content};
  const Extent extents[2] = {extent_of(relevance, dim, layer_count),
                             extent_of(content, dim, layer_count)};
  if (extents[0].heads && extents[1].heads && extents[0].heads != extents[1].heads) {
    fail(ErrorCode::invalid_argument, content.name, " has ", extents[1].heads, " heads, expected ",
         extents[0].heads, " (the heads of ", relevance.name, ")");
  }
  const std::int64_t heads = std::max<std::int64_t>({1, extents[0].heads, extents[1].heads});
  // One shared layer unless an array or a random operator differs from layer to layer.
  bool per_layer = extents[0].layers > 0 || extents[1].layers > 0;
  for (const OperatorSource<T>* s : sources) {
    per_layer =
        per_layer || (s->array.size() == 0 && s->kind == OperatorKind::random && layer_count > 1);
  }
  const std::int64_t count = per_layer ? layer_count : 1;

  std::vector<FlowLayer<T>> layers(static_cast<std::size_t>(count));
  for (std::int64_t l = 0; l < count; ++l) {
    FlowLayer<T>& layer = layers[static_cast<std::size_t>(l)];
    layer.heads = heads;
    for (int which = 0; which < 2; ++which) {
      const OperatorSource<T>& s = *sources[which];
      std::vector<T>& target = which == 0 ? layer.relevance : layer.content;
      target.reserve(static_cast<std::size_t>(heads * dim * dim));
      for (std::int64_t h = 0; h < heads; ++h) {
        if (s.array.size() == 0) {
          // Streams: (layer, head, M or F) of the seed, disjoint from the clouds' streams.
          const std::uint64_t stream =
              (static_cast<std::uint64_t>(l * heads + h) << 1 | static_cast<std::uint64_t>(which)) +
              (std::uint64_t{1} << 40);
          const auto op = make_operator<T>(s.kind, dim, seed ^ (stream * 0x9E3779B97F4A7C15ull));
          target.insert(target.end(), op.begin(), op.end());
        } else {
          const std::int64_t file_heads = extents[which].heads;
          const std::int64_t layer_index = extents[which].layers > 0 ? l : 0;
          const T* from =
              s.array.data() + ((layer_index * file_heads) + (file_heads == 1 ? 0 : h)) * dim * dim;
          target.insert(target.end(), from, from + dim * dim);
        }
      }
    }
  }
  return layers;
}

template <class T>
std::vector<FlowLayer<T>> layer_stack(const std::vector<MultiHeadAttentionWeights>& weights) {
  std::vector<FlowLayer<T>> layers;
  layers.reserve(weights.size());
  for (const MultiHeadAttentionWeights& w : weights) layers.push_back(layer_from_mha<T>(w));
  return layers;
}

#define EMFLOW_LAYER_STACK_INSTANTIATE(T)                                                   \
  template std::vector<FlowLayer<T>> layer_stack<T>(const OperatorSource<T>&,               \
                                                    const OperatorSource<T>&, std::int64_t, \
                                                    std::int64_t, std::uint64_t);           \
  template std::vector<FlowLayer<T>> layer_stack<T>(const std::vector<MultiHeadAttentionWeights>&);

EMFLOW_LAYER_STACK_INSTANTIATE(float)
EMFLOW_LAYER_STACK_INSTANTIATE(double)
#undef EMFLOW_LAYER_STACK_INSTANTIATE

}  // namespace emflow::flow
