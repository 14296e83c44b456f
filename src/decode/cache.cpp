// emflow::BasicDecodeCache (include/emflow/decode.hpp). The float cache of the dense form keeps
// the keys and contents of a growing cloud in the fused CPU engine's layout, so that attend() runs
// the engine's attention phase alone; double and the factored form use decode::KeyStore
// (keys.hpp).
//
// Engine storage: the keys as transposed panels of key_tile() tokens (dim x key_tile floats each),
// shared by every head, and per head the contents C_h = X F_h^T, rows padded to whole vectors.
// Capacity doubles when full, and the rows are copied, never recomputed, so an append of n
// tokens costs O(n H d^2) amortised and attend() of Nq queries O(Nq H N d).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "core/backends.hpp"
#include "core/check.hpp"
#include "core/queries.hpp"
#include "core/rotary.hpp"
#include "core/validate.hpp"
#include "cpu/engine.hpp"
#include "cuda/decode_cache.hpp"
#include "decode/keys.hpp"
#include "emflow/capability.hpp"
#include "emflow/decode.hpp"
#include "emflow/error.hpp"

namespace emflow {

namespace {

constexpr const char* kOperation = "DecodeCache";
// How route()'s refusals of a cache name it: the device asked for is the argument at fault.
constexpr const char* kDevice = "DecodeCache: argument 'device'";
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

/// The float dense cache in the engine's layout.
struct EngineCache {
  std::int64_t dim = 0, heads = 0, size = 0, capacity = 0;
  std::int64_t value_stride = 0;
  std::vector<float> relevance, content, key_bias, offset;  // the operators, copied
  AttentionInput<float> input;                              // over the copies, for DenseMaps
  std::unique_ptr<detail::cpu::DenseMaps> maps;
  Rows panels;               // capacity / key_tile panels of dim x key_tile
  std::vector<Rows> values;  // per head: capacity x value_stride

  EngineCache(const LayerOperators<float>& layer, std::int64_t d, double beta) {
    dim = d;
    heads = layer.heads;
    const std::int64_t ops = layer.heads * dim * dim;
    relevance.assign(layer.relevance, layer.relevance + ops);
    content.assign(layer.content, layer.content + ops);
    if (layer.key_bias) key_bias.assign(layer.key_bias, layer.key_bias + layer.heads * dim);
    if (layer.offset) offset.assign(layer.offset, layer.offset + dim);
    input.dim = dim;
    input.tokens = 1;
    input.beta = beta;
    input.layer = {layer.heads, relevance.data(), content.data(),
                   key_bias.empty() ? nullptr : key_bias.data(),
                   offset.empty() ? nullptr : offset.data()};
    maps = std::make_unique<detail::cpu::DenseMaps>(input);
    value_stride = detail::cpu::padded_columns(dim);
    values.resize(static_cast<std::size_t>(layer.heads));
  }

  void reserve(std::int64_t tokens) {
    if (tokens <= capacity) return;
    std::int64_t grown = std::max<std::int64_t>(capacity, kRowAlign);
    while (grown < tokens) grown *= 2;
    panels.grow(grown * dim);
    for (Rows& v : values) v.grow(grown * value_stride);
    capacity = grown;
  }

  void append(const float* tokens, std::int64_t count) {
    // Projections write whole groups of four rows: room past the new tokens.
    reserve(size + count + 4);
    detail::cpu::pack_key_rows(tokens, dim, size, count, panels.data());
    for (std::int64_t h = 0; h < heads; ++h) {
      detail::cpu::project_rows(tokens, count, dim, maps->value_map.data() + h * dim * value_stride,
                                value_stride,
                                values[static_cast<std::size_t>(h)].data() + size * value_stride);
    }
    size += count;
  }

  void clear() {
    size = 0;
    panels.zero();
    for (Rows& v : values) v.zero();
  }

  void attend(const float* queries, std::int64_t count, const detail::QueryRule& rule,
              const AttentionOutput<float>& output, int threads) const {
    detail::cpu::CachedOperands keys;
    keys.tokens = size;
    keys.panels = panels.data();
    for (const Rows& v : values) keys.values.push_back(v.data());
    detail::cpu::attend_cached(queries, count, rule, keys, maps->layer, output, threads);
  }
};

void check_beta(double beta) {
  if (!std::isfinite(beta) || std::abs(beta) > 18446744073709551616.0) {
    detail::fail_argument(kOperation, "beta", "must be finite with |beta| <= 2^64, got ", beta);
  }
}

/// The grouping and the rotary embedding of a factored cache's layer: as attend_factored checks
/// them, and positions that the cache's own rule gives (key j at position j, the queries at
/// attend()'s query_position), with frequencies fixed for every length.
template <class T>
void check_rotary_cache(const FactoredLayer<T>& layer) {
  detail::check_grouping_and_rotary(layer.heads, layer.rank, layer.kv_heads, layer.rotary, 1, 0, 0,
                                    kOperation, detail::Lengths::host);
  if (layer.rotary.key_positions != nullptr) {
    detail::fail_argument(kOperation, "rotary.key_positions",
                          "must be null: the cache rotates key j at position j, when it is "
                          "appended");
  }
  if (layer.rotary.query_positions != nullptr) {
    detail::fail_argument(kOperation, "rotary.query_positions",
                          "must be null: attend() rotates its queries at query_position + i");
  }
  detail::check_fixed_frequencies(layer.rotary, kOperation,
                                  "a cache rotates each key once, when it is appended, and the "
                                  "dynamic frequencies change as the cloud grows");
}

/// The capacity (>= 0; >= 1 when the GPU is asked for by name) and the precision of the storage
/// type (as ExecutionOptions::precision).
template <class T>
void check_options(const DecodeOptions& options) {
  if (options.capacity < 0 || (options.device == Device::cuda && options.capacity < 1)) {
    detail::fail_argument(kOperation, "capacity",
                          options.device == Device::cuda ? "must be >= 1 on Device::cuda, got "
                                                         : "must be >= 0, got ",
                          options.capacity);
  }
  const std::string mismatch = detail::precision_mismatch(dtype_of<T>(), options.precision);
  if (!mismatch.empty()) detail::fail_argument(kOperation, "precision", mismatch);
}

}  // namespace

template <class T>
struct BasicDecodeCache<T>::State {
  std::int64_t dim = 0, heads = 0, size = 0, capacity = 0;
  std::unique_ptr<detail::decode::DeviceCache> device;  // float, dense form, Device::cuda
  std::unique_ptr<EngineCache> engine;                  // float, dense form
  std::unique_ptr<detail::decode::KeyStore<T>> store;   // otherwise
};

template <class T>
BasicDecodeCache<T>::BasicDecodeCache(const LayerOperators<T>& layer, std::int64_t dim, double beta)
    : BasicDecodeCache(layer, dim, beta, DecodeOptions{}) {}

template <class T>
BasicDecodeCache<T>::BasicDecodeCache(const LayerOperators<T>& layer, std::int64_t dim, double beta,
                                      const DecodeOptions& options)
    : state_(std::make_unique<State>()) {
  detail::expect_positive(kOperation, "dim", dim);
  detail::expect_positive(kOperation, "heads", layer.heads);
  detail::expect_not_null(kOperation, "relevance", layer.relevance);
  detail::expect_not_null(kOperation, "content", layer.content);
  detail::checked_multiply(kOperation, "relevance",
                           detail::checked_multiply(kOperation, "relevance", layer.heads, dim),
                           dim);
  check_beta(beta);
  check_options<T>(options);
  state_->dim = dim;
  state_->heads = layer.heads;
  state_->capacity = options.capacity;
  const Route route = require_route(describe(layer, dim, options), options.device, kDevice);
  if (route.device == Device::cuda) {
    if constexpr (std::is_same_v<T, float>) {
      state_->device =
          std::make_unique<detail::decode::DeviceCache>(layer, dim, beta, options.capacity);
    }
  } else if (route.kernel == Kernel::cpu_fused) {
    if constexpr (std::is_same_v<T, float>) {
      state_->engine = std::make_unique<EngineCache>(layer, dim, beta);
    }
  } else {
    state_->store = std::make_unique<detail::decode::KeyStore<T>>(layer, dim, beta);
  }
  if (!state_->device && !state_->engine && !state_->store) {
    detail::fail(ErrorCode::internal, kOperation, ": no cache for the route ", to_string(route));
  }
}

template <class T>
BasicDecodeCache<T>::BasicDecodeCache(const FactoredLayer<T>& layer, std::int64_t dim, double beta)
    : BasicDecodeCache(layer, dim, beta, DecodeOptions{}) {}

template <class T>
BasicDecodeCache<T>::BasicDecodeCache(const FactoredLayer<T>& layer, std::int64_t dim, double beta,
                                      const DecodeOptions& options)
    : state_(std::make_unique<State>()) {
  detail::expect_positive(kOperation, "dim", dim);
  detail::expect_positive(kOperation, "heads", layer.heads);
  detail::expect_positive(kOperation, "rank", layer.rank);
  detail::expect_not_null(kOperation, "query_factor", layer.query_factor);
  detail::expect_not_null(kOperation, "key_factor", layer.key_factor);
  detail::expect_not_null(kOperation, "content_up", layer.content_up);
  detail::expect_not_null(kOperation, "content_down", layer.content_down);
  detail::checked_multiply(
      kOperation, "query_factor",
      detail::checked_multiply(kOperation, "query_factor", layer.heads, layer.rank), dim);
  check_beta(beta);
  check_options<T>(options);
  check_rotary_cache(layer);
  state_->dim = dim;
  state_->heads = layer.heads;
  state_->capacity = options.capacity;
  // The factored form is held in a KeyStore on the host (route() says so for every device that
  // takes it, and refuses the others).
  const Route route = require_route(describe(layer, dim, options), options.device, kDevice);
  if (route.device != Device::cpu || route.kernel != Kernel::reference) {
    detail::fail(ErrorCode::internal, kOperation, ": no factored cache for the route ",
                 to_string(route));
  }
  state_->store = std::make_unique<detail::decode::KeyStore<T>>(layer, dim, beta);
}

template <class T>
BasicDecodeCache<T>::~BasicDecodeCache() = default;
template <class T>
BasicDecodeCache<T>::BasicDecodeCache(BasicDecodeCache&&) noexcept = default;
template <class T>
BasicDecodeCache<T>& BasicDecodeCache<T>::operator=(BasicDecodeCache&&) noexcept = default;

template <class T>
std::int64_t BasicDecodeCache<T>::size() const noexcept {
  return state_ ? state_->size : 0;
}
template <class T>
std::int64_t BasicDecodeCache<T>::dim() const noexcept {
  return state_ ? state_->dim : 0;
}
template <class T>
std::int64_t BasicDecodeCache<T>::heads() const noexcept {
  return state_ ? state_->heads : 0;
}
template <class T>
bool BasicDecodeCache<T>::factored() const noexcept {
  return state_ && state_->store && state_->store->factored();
}

template <class T>
Device BasicDecodeCache<T>::device() const noexcept {
  return state_ && state_->device ? Device::cuda : Device::cpu;
}
template <class T>
std::int64_t BasicDecodeCache<T>::capacity() const noexcept {
  return state_ ? state_->capacity : 0;
}

template <class T>
void BasicDecodeCache<T>::append(const T* tokens, std::int64_t count) {
  const char* const op = "DecodeCache::append";
  if (!state_) detail::fail_argument(op, "cache", "was moved from");
  State& s = *state_;
  if (count < 0) detail::fail_argument(op, "count", "must be >= 0, got ", count);
  if (count == 0) return;
  detail::expect_not_null(op, "tokens", tokens);
  if (s.capacity > 0 && count > s.capacity - s.size) {
    detail::fail_argument(op, "count", count, " tokens after ", s.size,
                          " would exceed the capacity of ", s.capacity);
  }
  for (std::int64_t t = 0; t < count; ++t) {
    for (std::int64_t a = 0; a < s.dim; ++a) {
      if (!std::isfinite(tokens[t * s.dim + a])) {
        detail::fail_argument(op, "tokens", "row ", t, " holds a non-finite value");
      }
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (s.engine) s.engine->append(tokens, count);
    if (s.device) s.device->append(tokens, s.size, count);
  }
  if (s.store) s.store->append(tokens, count);
  s.size += count;
}

template <class T>
void BasicDecodeCache<T>::clear() noexcept {
  if (!state_) return;
  state_->size = 0;
  if (state_->engine) state_->engine->clear();
  if (state_->store) state_->store->clear();
}

template <class T>
void BasicDecodeCache<T>::attend(const T* queries, std::int64_t count, const Mask& mask,
                                 const AttentionOutput<T>& output, std::int64_t query_position,
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
  check_threads(threads, op);
  constexpr std::int64_t kLimit = std::int64_t{1} << 60;
  const std::int64_t origin = query_position == kAlignToEnd ? s.size - count : query_position;
  if (origin < -kLimit || origin > kLimit - count) {
    detail::fail_argument(op, "query_position", "must keep its positions within +-2^60, got ",
                          origin);
  }
  const std::int64_t rows = count * s.heads;
  const detail::MemoryRange ranges[] = {
      {"queries", queries, static_cast<std::size_t>(count * s.dim) * sizeof(T), false},
      {"update", output.update, static_cast<std::size_t>(count * s.dim) * sizeof(T), true},
      {"lse", output.lse, static_cast<std::size_t>(rows) * sizeof(T), true},
      {"entropy", output.entropy, static_cast<std::size_t>(rows) * sizeof(T), true},
  };
  detail::check_disjoint(ranges, sizeof ranges / sizeof ranges[0], op);

  detail::QueryRule rule;
  rule.mask = mask;
  rule.key_length = s.size;
  rule.query_length = count;
  rule.query_origin = origin;
  if (s.size == 0) {  // nothing to see: every query gets 0, -inf, 0
    std::fill(output.update, output.update + count * s.dim, T(0));
    if (output.lse) std::fill(output.lse, output.lse + rows, -std::numeric_limits<T>::infinity());
    if (output.entropy) std::fill(output.entropy, output.entropy + rows, T(0));
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (s.engine) {
      s.engine->attend(queries, count, rule, output, threads);
      return;
    }
    if (s.device) {
      s.device->attend(queries, count, rule, output);
      return;
    }
  }
  s.store->attend(queries, count, rule, output, threads);
}

template class BasicDecodeCache<float>;
template class BasicDecodeCache<double>;

}  // namespace emflow
