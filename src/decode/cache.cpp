// emflow::DecodeCache (include/emflow/decode.hpp): the keys and contents of a growing cloud in
// the fused CPU engine's layout, so that attend() runs the engine's attention phase alone.
//
// Storage: the keys as transposed panels of key_tile() tokens (dim x key_tile floats each),
// shared by every head, and per head the contents C_h = X F_h^T, rows padded to whole vectors.
// Capacity doubles when full, and the rows are copied, never recomputed, so an append of n
// tokens costs O(n H d^2) amortised and attend() of Nq queries O(Nq H N d).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/backends.hpp"
#include "core/check.hpp"
#include "core/queries.hpp"
#include "cpu/engine.hpp"
#include "emflow/decode.hpp"
#include "emflow/error.hpp"

namespace emflow {

namespace {

constexpr const char* kOperation = "DecodeCache";
constexpr std::int64_t kRowAlign = 64;  // rows held: a multiple of this, and past the tokens

/// Zero-filled float storage that keeps its contents when it grows.
class Rows {
 public:
  void grow(std::int64_t floats) {
    std::vector<float> bigger(static_cast<std::size_t>(floats), 0.0f);
    std::copy(data_.begin(), data_.end(), bigger.begin());
    data_.swap(bigger);
  }
  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }
  void zero() { std::fill(data_.begin(), data_.end(), 0.0f); }

 private:
  std::vector<float> data_;
};

}  // namespace

struct DecodeCache::State {
  std::int64_t dim = 0, heads = 0, size = 0, capacity = 0;
  std::int64_t value_stride = 0;
  std::vector<float> relevance, content, key_bias, offset;  // the operators, copied
  AttentionInput<float> input;                              // over the copies, for DenseMaps
  std::unique_ptr<detail::cpu::DenseMaps> maps;
  Rows panels;               // capacity / key_tile panels of dim x key_tile
  std::vector<Rows> values;  // per head: capacity x value_stride

  void reserve(std::int64_t tokens) {
    if (tokens <= capacity) return;
    std::int64_t grown = std::max<std::int64_t>(capacity, kRowAlign);
    while (grown < tokens) grown *= 2;
    panels.grow(grown * dim);
    for (Rows& v : values) v.grow(grown * value_stride);
    capacity = grown;
  }
};

DecodeCache::DecodeCache(const LayerOperators<float>& layer, std::int64_t dim, double beta)
    : state_(std::make_unique<State>()) {
  detail::expect_positive(kOperation, "dim", dim);
  detail::expect_positive(kOperation, "heads", layer.heads);
  detail::expect_not_null(kOperation, "relevance", layer.relevance);
  detail::expect_not_null(kOperation, "content", layer.content);
  detail::checked_multiply(kOperation, "relevance",
                           detail::checked_multiply(kOperation, "relevance", layer.heads, dim),
                           dim);
  if (!std::isfinite(beta) || std::abs(beta) > 18446744073709551616.0) {
    detail::fail_argument(kOperation, "beta", "must be finite with |beta| <= 2^64, got ", beta);
  }
  State& s = *state_;
  s.dim = dim;
  s.heads = layer.heads;
  const std::int64_t ops = layer.heads * dim * dim;
  s.relevance.assign(layer.relevance, layer.relevance + ops);
  s.content.assign(layer.content, layer.content + ops);
  if (layer.key_bias) s.key_bias.assign(layer.key_bias, layer.key_bias + layer.heads * dim);
  if (layer.offset) s.offset.assign(layer.offset, layer.offset + dim);
  s.input.dim = dim;
  s.input.tokens = 1;
  s.input.beta = beta;
  s.input.layer = {layer.heads, s.relevance.data(), s.content.data(),
                   s.key_bias.empty() ? nullptr : s.key_bias.data(),
                   s.offset.empty() ? nullptr : s.offset.data()};
  s.maps = std::make_unique<detail::cpu::DenseMaps>(s.input);
  s.value_stride = detail::cpu::padded_columns(dim);
  s.values.resize(static_cast<std::size_t>(layer.heads));
}

DecodeCache::~DecodeCache() = default;
DecodeCache::DecodeCache(DecodeCache&&) noexcept = default;
DecodeCache& DecodeCache::operator=(DecodeCache&&) noexcept = default;

std::int64_t DecodeCache::size() const noexcept { return state_ ? state_->size : 0; }
std::int64_t DecodeCache::dim() const noexcept { return state_ ? state_->dim : 0; }
std::int64_t DecodeCache::heads() const noexcept { return state_ ? state_->heads : 0; }

void DecodeCache::append(const float* tokens, std::int64_t count) {
  const char* const op = "DecodeCache::append";
  if (!state_) detail::fail_argument(op, "cache", "was moved from");
  State& s = *state_;
  if (count < 0) detail::fail_argument(op, "count", "must be >= 0, got ", count);
  if (count == 0) return;
  detail::expect_not_null(op, "tokens", tokens);
  for (std::int64_t t = 0; t < count; ++t) {
    if (!detail::cpu::all_finite(tokens + t * s.dim, s.dim)) {
      detail::fail_argument(op, "tokens", "row ", t, " holds a non-finite value");
    }
  }
  // Projections write whole groups of four rows: room past the new tokens.
  s.reserve(s.size + count + 4);
  detail::cpu::pack_key_rows(tokens, s.dim, s.size, count, s.panels.data());
  for (std::int64_t h = 0; h < s.heads; ++h) {
    detail::cpu::project_rows(
        tokens, count, s.dim, s.maps->value_map.data() + h * s.dim * s.value_stride, s.value_stride,
        s.values[static_cast<std::size_t>(h)].data() + s.size * s.value_stride);
  }
  s.size += count;
}

void DecodeCache::clear() noexcept {
  if (!state_) return;
  state_->size = 0;
  state_->panels.zero();
  for (Rows& v : state_->values) v.zero();
}

void DecodeCache::attend(const float* queries, std::int64_t count, const Mask& mask,
                         const AttentionOutput<float>& output, std::int64_t query_position,
                         int threads) const {
  const char* const op = "DecodeCache::attend";
  if (!state_) detail::fail_argument(op, "cache", "was moved from");
  const State& s = *state_;
  detail::expect_positive(op, "count", count);
  detail::expect_not_null(op, "queries", queries);
  detail::expect_not_null(op, "update", output.update);
  if (output.weights != nullptr) detail::fail_argument(op, "weights", "must be null");
  if (mask.kind == MaskKind::window && mask.window < 1) {
    detail::fail_argument(op, "mask", "window width must be >= 1, got ", mask.window);
  }
  if (threads < 0) detail::fail_argument(op, "threads", "must be >= 0, got ", threads);
  constexpr std::int64_t kLimit = std::int64_t{1} << 60;
  const std::int64_t origin = query_position == kAlignToEnd ? s.size - count : query_position;
  if (origin < -kLimit || origin > kLimit - count) {
    detail::fail_argument(op, "query_position", "must keep its positions within +-2^60, got ",
                          origin);
  }
  const std::int64_t rows = count * s.heads;
  const detail::MemoryRange ranges[] = {
      {"queries", queries, static_cast<std::size_t>(count * s.dim) * sizeof(float), false},
      {"update", output.update, static_cast<std::size_t>(count * s.dim) * sizeof(float), true},
      {"lse", output.lse, static_cast<std::size_t>(rows) * sizeof(float), true},
      {"entropy", output.entropy, static_cast<std::size_t>(rows) * sizeof(float), true},
  };
  detail::check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);

  detail::QueryRule rule;
  rule.mask = mask;
  rule.key_length = s.size;
  rule.query_length = count;
  rule.query_origin = origin;
  detail::cpu::CachedOperands keys;
  keys.tokens = s.size;
  keys.panels = s.panels.data();
  for (const Rows& v : s.values) keys.values.push_back(v.data());
  if (s.size == 0) {  // nothing to see: every query gets 0, -inf, 0
    std::fill(output.update, output.update + count * s.dim, 0.0f);
    if (output.lse) std::fill(output.lse, output.lse + rows, -INFINITY);
    if (output.entropy) std::fill(output.entropy, output.entropy + rows, 0.0f);
    return;
  }
  detail::cpu::attend_cached(queries, count, rule, keys, s.maps->layer, output, threads);
}

}  // namespace emflow
