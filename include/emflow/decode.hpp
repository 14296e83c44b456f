// emflow: incremental decoding of a growing cloud (docs/MATH.md §1.6).
//
// A decoder adds one token (or a few) at a time and attends the new tokens to everything before:
// in EMF terms a growing cloud whose keys and contents are kept. A DecodeCache holds, for one
// layer and one cloud, what the keys contribute to every later query, so that append() of n
// tokens costs O(n H d^2) (O(n H r d) factored) without touching the old ones and attend() of
// Nq queries O(Nq H N d) (O(Nq H N r) factored), the keys split across threads when the queries
// are few.
//
// Dense form (M_h, F_h, u_h, c): the keys x_j (shared by every head: the relevance and the key
// bias act through the queries, s_ij = <beta (M_h^T q_i + u_h), x_j>) and per head the contents
// C_h = X F_h^T. Factored form (FactoredLayer, factored.hpp): per kv head g the projected keys
// K_g = X B_g^T and the values V_g = X V_g^T, and per head the key bias u_h^T x_j; attend()
// projects its queries with A_h and maps the weighted values back with U_h. With grouped kv heads
// (FactoredLayer::kv_heads = K < heads) only the K sets of keys and values are stored, and query
// head h reads set h / (heads / K), as attend_factored does.
//
// Rotary positions (FactoredLayer::rotary, docs/MATH.md §2.4): append() rotates each projected
// key once, at its position, and stores it rotated; attend() rotates each projected query at its
// position. That is exact: the score <R(p_i) A_h q_i, R(p_j) B_g x_j> is the one of
// x_i^T A_h^T R(p_j - p_i) B_g x_j, since R(p_i)^T R(p_j) = R(p_j - p_i), so the key's rotation
// depends on its own position alone and never has to be redone as the cloud grows. The
// positions are the cache's (below): rotary.key_positions and rotary.query_positions must be
// null. The frequencies are fixed when the cache is made: the dynamic scaling, whose frequencies
// grow with the sequence, is refused (ErrorCode::unsupported) unless given as
// rotary.inverse_frequencies.
//
// Positions: key j of the cache sits at position j; the queries of attend() at
// [query_position, query_position + Nq), by default (kAlignToEnd) the last Nq positions
// (size() - Nq + i), as in a decoder whose new tokens were just appended. Masks then act as for
// emflow::attend (attention.hpp), and the rotation as for attend_factored with key_position 0 and
// that query_position. Decoding a cloud token by token (append x_t, attend x_t under the causal
// mask) gives the rows of the causal one-pass update (attend_factored's, rotary and grouped heads
// included, for the factored form).
//
// Where a cache lives is route()'s answer (capability.hpp, Operation::decode) for the cache's
// layer, storage type and DecodeOptions, asked once by the constructor:
// * BasicDecodeCache<float> (DecodeCache) in the dense form on the host runs the fused float32
//   engine of Device::cpu; the factored form and double compute each query's scores and sums in
//   double (the keys and values held in T, each rounded once). Where the engine runs on the
//   processor, the float factored form computes in float32 as attend_factored does: its
//   projections (B_g x_j and V_g x_j when appending, A_h q and sum_h U_h o_h when attending) are
//   the engine's products, and each query's scores, softmax (the engine's exp) and weighted
//   values are float32 sums; the merge of key splits stays in double. Elsewhere it computes in
//   double. Non-finite tokens are not supported (append refuses them, naming the row).
// * On the GPU (float, dense form, dim <= 256, a capacity): the keys and contents live in device
//   buffers of a fixed capacity. append() copies the new tokens to the device on the cache's own
//   stream and projects them there; attend() copies the queries in and runs the fused kernel with
//   the keys split into blocks merged exactly (flash-decoding, as
//   emflow::cuda::attend_partial_async does), so one query against many keys uses the whole
//   device, then copies the outputs back. Both take and return host arrays and return once the
//   device is done. The GPU holds no factored cache: a rotary or grouped layer is refused there
//   by name (route()'s reason), and Device::automatic keeps it on the host.
// DecodeOptions::device is Device::automatic by default, as for every other entry point: the GPU
// when route() names it (a usable device, a cache it holds, and a capacity), else the host.
// Device::cuda for a cache the GPU does not hold, or without a usable device, is refused
// (ErrorCode::unsupported, naming 'device' and route()'s reason); so is Device::reference, which
// holds no cache.
#pragma once

#include <cstdint>
#include <memory>

#include "emflow/attention.hpp"
#include "emflow/factored.hpp"

namespace emflow {

/// Where a cache lives and how it computes (see above).
struct DecodeOptions {
  /// automatic (the GPU when route() names it, else the host), cpu or cuda.
  Device device = Device::automatic;
  /// The most tokens the cache will hold: required on the GPU (>= 1; Device::cuda with 0 is
  /// invalid_argument naming 'capacity', Device::automatic with 0 stays on the host); on the host
  /// the cache grows as needed and a capacity > 0 is a limit that append() enforces.
  std::int64_t capacity = 0;
  /// As ExecutionOptions::precision (attention.hpp): fp32, or tf32 for float (a permission that
  /// every cache kernel meets with float32 products); other pairs are invalid_argument.
  Precision precision = Precision::fp32;
};

template <class T>
class BasicDecodeCache {
 public:
  /// Copies the operators of `layer` (heads, dim); throws emflow::Error (invalid_argument) on a
  /// null relevance or content, dim or heads < 1, or a non-finite beta.
  BasicDecodeCache(const LayerOperators<T>& layer, std::int64_t dim, double beta = 1.0);
  /// The same with `options` (see above): Device::cuda needs T = float, dim <= 256 and
  /// capacity >= 1 (else ErrorCode::unsupported naming 'device', invalid_argument naming
  /// 'capacity').
  BasicDecodeCache(const LayerOperators<T>& layer, std::int64_t dim, double beta,
                   const DecodeOptions& options);
  /// The factored form: copies the factors (B and V of layer.kv_heads heads) and the rotary
  /// embedding (its explicit inverse frequencies too); throws emflow::Error (invalid_argument)
  /// naming a null factor, dim, heads or rank < 1, a non-finite beta, kv_heads that do not
  /// divide heads, a bad rotary field (as attend_factored) or rotary positions given (the cache
  /// has its own), and (unsupported) naming rotary.scaling for the dynamic scaling without
  /// explicit frequencies.
  BasicDecodeCache(const FactoredLayer<T>& layer, std::int64_t dim, double beta = 1.0);
  /// The same with `options`: the factored form lives on the host (Device::cuda is refused with
  /// route()'s reason).
  BasicDecodeCache(const FactoredLayer<T>& layer, std::int64_t dim, double beta,
                   const DecodeOptions& options);
  ~BasicDecodeCache();
  BasicDecodeCache(BasicDecodeCache&&) noexcept;
  BasicDecodeCache& operator=(BasicDecodeCache&&) noexcept;
  BasicDecodeCache(const BasicDecodeCache&) = delete;
  BasicDecodeCache& operator=(const BasicDecodeCache&) = delete;

  std::int64_t size() const noexcept;  ///< tokens held, N
  std::int64_t dim() const noexcept;
  std::int64_t heads() const noexcept;
  bool factored() const noexcept;
  Device device() const noexcept;          ///< Device::cuda or Device::cpu
  std::int64_t capacity() const noexcept;  ///< 0: grows without limit

  /// Appends `count` tokens (count x dim, row-major): their keys and contents, token t at
  /// position size() + t (a rotary layer's keys rotated there, once). Storage grows
  /// geometrically; the old tokens are moved, never recomputed. Throws emflow::Error
  /// (invalid_argument) naming the first row that holds a non-finite value, or naming 'count'
  /// when the tokens would exceed the capacity.
  void append(const T* tokens, std::int64_t count);

  /// Drops every token (the operators stay).
  void clear() noexcept;

  /// The update of `count` queries (count x dim) against every token of the cache under `mask`,
  /// written to output.update (count x dim) and, when not null, output.lse and output.entropy
  /// (heads x count); output.weights must be null. Same rules as emflow::attend (a query that
  /// sees no key gets 0, -inf, 0). Query i sits at query_position + i (kAlignToEnd: the last
  /// `count` positions, size() - count + i), for the mask and a rotary layer's rotation.
  void attend(const T* queries, std::int64_t count, const Mask& mask,
              const AttentionOutput<T>& output, std::int64_t query_position = kAlignToEnd,
              int threads = 0) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

using DecodeCache = BasicDecodeCache<float>;

extern template class BasicDecodeCache<float>;
extern template class BasicDecodeCache<double>;

}  // namespace emflow
