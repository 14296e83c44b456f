// The fused float32 engine behind the fast CPU backend: softmax attention of a batch of clouds
// against one layer of heads, in O(N d) memory, for both forms of a layer.
//
// A layer reaches the engine as four per-head linear maps of the cloud, already transposed and
// padded to whole vectors by the caller (attend.cpp for the dense form, factored.cpp for the
// factored form):
//
//   queries  Q_h = X query_map_h + 1 query_bias_h^T        (N x score_dim), beta folded in
//   keys     K_h = X key_map_h, or X itself when key_map is null (score_dim == dim)
//   values   V_h = X value_map_h                             (N x value_dim)
//   update   delta_i = sum_h (softmax_j(<q_i, k_j>) V_h)_i output_map_h  (+ offset)
//            with output_map null meaning the identity (value_dim == dim)
//
// Dense EMF: query_map = beta M_h, query_bias = beta u_h, keys = X, value_map = F_h^T.
// Factored:  query_map = [beta A_h^T | 0], query_bias = e_r, key_map = [B_h^T | beta u_h],
//            value_map = V_h^T, output_map = U_h^T; with grouped kv heads the key and value
//            maps of a kv head serve its group, and with rotary positions the projected queries
//            and keys are rotated by their positions before they meet.
#pragma once

#include <cstdint>
#include <vector>

#include "core/queries.hpp"
#include "core/rotary.hpp"
#include "emflow/attention.hpp"
#include "emflow/partial.hpp"
#include "target.hpp"

namespace emflow::detail::cpu {

/// One layer in the engine's terms. Maps are row-major, heads one after another, each row padded
/// with zeros to padded_columns(columns) floats.
struct EngineLayer {
  std::int64_t heads = 1;
  std::int64_t dim = 1;               ///< d: columns of the cloud and of the update
  std::int64_t score_dim = 1;         ///< columns of queries and keys
  std::int64_t value_dim = 1;         ///< columns of the values
  const float* query_map = nullptr;   ///< (heads, dim, padded(score_dim))
  const float* query_bias = nullptr;  ///< (heads, padded(score_dim)), or null
  const float* key_map = nullptr;     ///< (heads, dim, padded(score_dim)), or null: keys = cloud
  const float* value_map = nullptr;   ///< (heads, dim, padded(value_dim))
  const float* output_map = nullptr;  ///< (heads, value_dim, padded(dim)), or null: identity
  const float* offset = nullptr;      ///< (dim), or null
  /// Grouped heads: key_map holds key_sets maps and value_map value_sets, and head h reads set
  /// h / (heads / key_sets) and h / (heads / value_sets): each set is projected once per cloud
  /// and shared. 0 means heads. key_sets is ignored when key_map is null.
  std::int64_t key_sets = 0;
  std::int64_t value_sets = 0;
  /// Rotary positions (the factored form, key_map set): the first rotary->dim columns of every
  /// projected query and key rotated by its position (rotary.hpp); null: none.
  const RotaryCall* rotary = nullptr;
};

/// The clouds of one engine call: queries Q (batch, query_tokens, dim) against keys X (batch,
/// tokens, dim), each cloud with its visibility rule. For self-attention Q = X.
struct EngineClouds {
  const float* keys = nullptr;
  const float* queries = nullptr;
  std::int64_t batch = 1;
  std::int64_t tokens = 0;           ///< N: keys per cloud
  std::int64_t query_tokens = 0;     ///< Nq: queries per cloud
  const QueryRule* rules = nullptr;  ///< `batch` entries
  /// Whether the keys may be split into blocks across threads when the queries are few (their
  /// partial states merged exactly, docs/MATH.md §1.6). The split depends on the shape only,
  /// never on the thread count.
  bool split_keys = false;
};

/// Where the engine writes: the outputs of emflow::attend (Nq rows per cloud), or, when
/// partial.heads is set, the per-head partial state of partial.hpp (output_map must be null).
struct EngineOutput {
  AttentionOutput<float> attend;
  PartialOutput<float> partial;
};

/// A dense layer (M_h, F_h, u_h, c, beta of `input`) in the engine's terms (dispatch.cpp):
/// query_map_h = beta M_h (R = Q M_h), query_bias_h = beta u_h, value_map_h = F_h^T; the keys
/// are the cloud itself.
struct DenseMaps {
  std::vector<float> query_map, value_map, query_bias;
  EngineLayer layer;
  explicit DenseMaps(const AttentionInput<float>& input);
  DenseMaps(const DenseMaps&) = delete;
  DenseMaps& operator=(const DenseMaps&) = delete;
};

/// Keys and contents already in the engine's layout (a decode cache's), for one cloud: `panels`
/// shared by every head (dense form, score_dim = dim) and per head `values` rows of
/// padded_columns(value_dim) floats, both holding at least tokens rounded up to 64 rows.
struct CachedOperands {
  std::int64_t tokens = 0;
  const float* panels = nullptr;
  std::vector<const float*> values;
};

}  // namespace emflow::detail::cpu

// The functions of a path (target.hpp): in a path's compilation its own, elsewhere the calls
// through the path this process takes (dispatch.cpp).
EMFLOW_CPU_BEGIN

/// Row length of a padded map with `columns` columns.
std::int64_t padded_columns(std::int64_t columns);

/// Writes the keys [first, first + count) (rows of `dim` floats) into transposed panels of
/// dim x key_tile() floats, as attend_cached reads them.
void pack_key_rows(const float* rows, std::int64_t dim, std::int64_t first, std::int64_t count,
                   float* panels);

/// out[count x columns] = rows[count x dim] map[dim x columns]; writes whole groups of four rows,
/// so `out` must hold count rounded up to 4 rows (the extra rows get 0).
void project_rows(const float* rows, std::int64_t count, std::int64_t dim, const float* map,
                  std::int64_t columns, float* out);

/// emflow::attend of `query_tokens` queries (one cloud) against cached operands under `rule`;
/// the keys split across threads when the queries are few. output.weights must be null.
void attend_cached(const float* queries, std::int64_t query_tokens, const QueryRule& rule,
                   const CachedOperands& keys, const EngineLayer& layer,
                   const AttentionOutput<float>& output, int threads);

#if defined(EMFLOW_CPU_TARGET)  // within the paths only

/// Computes the outputs for every query of `clouds` on `threads` OpenMP threads (0: the OpenMP
/// default, or one thread for a call of under 4 MFLOP).
/// Results do not depend on the thread count: every output element is computed by one thread
/// in a fixed order (heads summed in order 0..H-1, key blocks merged in order).
/// Finite input only: the engine multiplies masked weights (0) by values, so a non-finite value
/// would give NaN where the reference gives a number; route() sends such input to the reference
/// (Problem::finite).
void fused_attend(const EngineClouds& clouds, const EngineLayer& layer, const EngineOutput& output,
                  int threads);

/// The rules of self-attention without positions: query i of cloud b sees the keys
/// mask.visible_keys(i, L_b).
std::vector<QueryRule> self_rules(std::int64_t batch, std::int64_t tokens, const Mask& mask,
                                  const std::int64_t* key_lengths);

/// Keys of tiles: the panels of attend_cached hold keys [t kKeyTile, (t + 1) kKeyTile) each.
std::int64_t key_tile();

#endif

EMFLOW_CPU_END
