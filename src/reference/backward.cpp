// The backward pass of docs/MATH.md §8 in double, written as the formulas read: the SDPA-shaped
// operator forward and backward (plain loops over b, h, i, j and the coordinates), and the dense
// and factored layers as that operator between projections, differentiated by the chain rule.
// These are the ground truth that the fast backward paths are held to; every gradient is tested
// against central differences of an independent forward (tests/reference/backward_test.cpp).
//
// What is read (§8.6): for each query that sees a key, its visible keys' rows; the rows of the
// chain rule's products are the rows that take part (queries that see a key, keys that such a
// query sees). Nothing else is read, so padding, masked pairs and queries without keys add
// nothing and get exact zeros whatever they hold; NaN is never tested for, so a non-finite value
// that is read reaches what the formulas carry it to.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "checks.hpp"
#include "core/queries.hpp"
#include "emflow/reference.hpp"

namespace emflow::reference {

namespace {

using detail::fail_argument;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// Index of element (b, h, i, a) of a dense (B, H, rows, cols) array.
std::int64_t at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t a, std::int64_t H,
                std::int64_t rows, std::int64_t cols) {
  return ((b * H + h) * rows + i) * cols + a;
}

/// The shape of the SDPA-shaped operator's arguments.
struct SdpaShape {
  std::int64_t batch = 0, query_heads = 0, kv_heads = 0, queries = 0, keys = 0, rank = 0,
               value_rank = 0;
  /// Query head h reads key and value head h / group.
  std::int64_t group() const { return query_heads / kv_heads; }
};

void expect_rank4(const char* op, const char* argument, const Tensor<double>& tensor,
                  const char* expected) {
  bool ok = tensor.rank() == 4;
  for (std::int64_t a = 0; ok && a < 4; ++a) ok = tensor.extent(a) >= 1;
  if (!ok) {
    fail_argument(op, argument, "has shape ", to_string(tensor.shape()), ", expected ", expected,
                  " with every extent >= 1");
  }
}

/// The visibility's lengths and positions, for B clouds of Nq queries and Nk keys.
void check_visibility(const char* op, const Visibility& v, std::int64_t B, std::int64_t Nq,
                      std::int64_t Nk) {
  detail::expect_valid_mask(op, v.mask);
  detail::expect_lengths(op, "key_lengths", v.key_lengths, B, Nk);
  detail::expect_lengths(op, "query_lengths", v.query_lengths, B, Nq);
  detail::expect_positions(op, "key_position", v.key_position, Nk);
  if (v.query_position != kAlignToEnd) {
    detail::expect_positions(op, "query_position", v.query_position, Nq);
  } else if (v.key_position != 0) {
    // The aligned origin key_position + Lk - Lq lies within [key_position - Nq, key_position + Nk].
    detail::expect_positions(op, "key_position", v.key_position - Nq, Nk + Nq);
  }
  if (!v.query_positions.empty()) {
    if (static_cast<std::int64_t>(v.query_positions.size()) != B) {
      fail_argument(op, "query_positions", "has ", v.query_positions.size(), " entries, expected ",
                    B, " (one per cloud)");
    }
    for (std::size_t b = 0; b < v.query_positions.size(); ++b) {
      if (v.query_positions[b] == kAlignToEnd) {
        fail_argument(op, "query_positions", "entry ", b, " must be a position, not kAlignToEnd");
      }
      detail::expect_positions(op, "query_positions", v.query_positions[b], Nq);
    }
  }
}

SdpaShape check_sdpa(const char* op, const Tensor<double>& queries, const Tensor<double>& keys,
                     const Tensor<double>& values, double scale, const Visibility& visibility) {
  expect_rank4(op, "queries", queries, "(B, Hq, Nq, r)");
  expect_rank4(op, "keys", keys, "(B, Hkv, Nk, r)");
  expect_rank4(op, "values", values, "(B, Hkv, Nk, rv)");
  SdpaShape s;
  s.batch = queries.extent(0);
  s.query_heads = queries.extent(1);
  s.queries = queries.extent(2);
  s.rank = queries.extent(3);
  s.kv_heads = keys.extent(1);
  s.keys = keys.extent(2);
  s.value_rank = values.extent(3);
  detail::expect_shape(op, "keys", keys, {s.batch, s.kv_heads, s.keys, s.rank});
  detail::expect_shape(op, "values", values, {s.batch, s.kv_heads, s.keys, s.value_rank});
  if (s.query_heads % s.kv_heads != 0) {
    fail_argument(op, "queries", "has ", s.query_heads,
                  " heads, expected a multiple of the key and value heads (", s.kv_heads, ")");
  }
  if (!std::isfinite(scale)) fail_argument(op, "scale", "must be finite, got ", scale);
  check_visibility(op, visibility, s.batch, s.queries, s.keys);
  return s;
}

/// The rule of cloud b: emflow::attend's, resolved by the one function that resolves it
/// (detail::query_rule) from the fields it reads. `self_attention`: the queries are the keys'
/// cloud, so query lengths default to the key lengths.
emflow::detail::QueryRule rule_of(const Visibility& v, std::int64_t b, std::int64_t Nq,
                                  std::int64_t Nk, bool self_attention) {
  static const double some_queries = 0.0;  // only tells query_rule "cross-attention"
  AttentionInput<double> in;
  in.tokens = Nk;
  in.mask = v.mask;
  in.key_lengths = v.key_lengths.empty() ? nullptr : v.key_lengths.data();
  in.queries = self_attention ? nullptr : &some_queries;
  in.query_tokens = self_attention ? 0 : Nq;
  in.query_lengths = v.query_lengths.empty() ? nullptr : v.query_lengths.data();
  in.key_position = v.key_position;
  in.query_position = v.query_position;
  in.query_positions = v.query_positions.empty() ? nullptr : v.query_positions.data();
  return emflow::detail::query_rule(in, b);
}

/// The forward state of one query row of one head (docs/MATH.md §1.4, §6.6): its visible keys,
/// the products <q_i, k_j>, the scores, the weights, lse and entropy. Entries outside `keys`
/// hold dot = 0, s = -inf, p = 0 and are never read.
struct Row {
  KeyRange keys;
  std::vector<double> dot, s, p;
  double lse = -kInf, entropy = 0.0;
};

/// The products <q_i, k_j> and scores s_ij = scale <q_i, k_j> of row i of query head h of cloud
/// b over its visible keys; the weights 0, lse -inf and H 0 until the caller sets them.
void scores_row(const Tensor<double>& Q, const Tensor<double>& K, const SdpaShape& sh, double scale,
                std::int64_t b, std::int64_t h, std::int64_t i, KeyRange keys, Row& row) {
  const std::int64_t r = sh.rank, Nk = sh.keys, g = h / sh.group();
  row.keys = keys;
  row.dot.assign(static_cast<std::size_t>(Nk), 0.0);
  row.s.assign(static_cast<std::size_t>(Nk), -kInf);
  row.p.assign(static_cast<std::size_t>(Nk), 0.0);
  row.lse = -kInf;
  row.entropy = 0.0;
  const double* q = Q.data() + at(b, h, i, 0, sh.query_heads, sh.queries, r);
  for (std::int64_t j = keys.first; j < keys.last; ++j) {
    const double* k = K.data() + at(b, g, j, 0, sh.kv_heads, Nk, r);
    double dot = 0.0;
    for (std::int64_t a = 0; a < r; ++a) dot += q[a] * k[a];
    row.dot[j] = dot;
    row.s[j] = scale * dot;
  }
}

/// Row i of query head h of cloud b.
void softmax_row(const Tensor<double>& Q, const Tensor<double>& K, const SdpaShape& sh,
                 double scale, std::int64_t b, std::int64_t h, std::int64_t i, KeyRange keys,
                 Row& row) {
  scores_row(Q, K, sh, scale, b, h, i, keys, row);
  if (keys.empty()) return;  // no visible key: p_i = 0, lse_i = -inf, H_i = 0

  // m_i = max_j s_ij, NaN as soon as one visible score is NaN.
  double m = -kInf;
  for (std::int64_t j = keys.first; j < keys.last; ++j) {
    if (row.s[j] > m || std::isnan(row.s[j])) m = row.s[j];
  }
  if (!std::isfinite(m)) {
    // A NaN or +inf score, or only -inf ones: the weights are undefined (§6.6).
    row.lse = row.entropy = kNaN;
    for (std::int64_t j = keys.first; j < keys.last; ++j) row.p[j] = kNaN;
    return;
  }
  // Z_i = sum_j exp(s_ij - m_i); lse_i = m_i + log Z_i; p_ij = exp(s_ij - lse_i);
  // H_i = lse_i - sum_j p_ij s_ij (a weight of 0 adds nothing: no 0 * -inf).
  double Z = 0.0;
  for (std::int64_t j = keys.first; j < keys.last; ++j) Z += std::exp(row.s[j] - m);
  row.lse = m + std::log(Z);
  double expected_score = 0.0;
  for (std::int64_t j = keys.first; j < keys.last; ++j) {
    row.p[j] = std::exp(row.s[j] - row.lse);
    if (row.p[j] != 0.0) expected_score += row.p[j] * row.s[j];
  }
  row.entropy = row.lse - expected_score;
}

/// Row i of query head h of cloud b with its statistics given (a forward pass over a key set of
/// which these keys are a block): the products and scores as above, lse_i and H_i as given,
/// p_ij = exp(s_ij - lse_i). A visible NaN score, or a NaN lse, gives NaN weights, as above.
void saved_row(const Tensor<double>& Q, const Tensor<double>& K, const SdpaShape& sh, double scale,
               std::int64_t b, std::int64_t h, std::int64_t i, KeyRange keys, double lse,
               double entropy, Row& row) {
  scores_row(Q, K, sh, scale, b, h, i, keys, row);
  row.lse = lse;
  row.entropy = entropy;
  for (std::int64_t j = keys.first; j < keys.last; ++j) row.p[j] = std::exp(row.s[j] - lse);
}

/// o_i = sum_j p_ij v_j over the visible keys, each of which counts even with p_ij = 0 (§6.6).
void weighted_values(const Tensor<double>& V, const SdpaShape& sh, std::int64_t b, std::int64_t h,
                     const Row& row, double* o) {
  const std::int64_t rv = sh.value_rank, g = h / sh.group();
  for (std::int64_t a = 0; a < rv; ++a) o[a] = 0.0;
  for (std::int64_t j = row.keys.first; j < row.keys.last; ++j) {
    const double* v = V.data() + at(b, g, j, 0, sh.kv_heads, sh.keys, rv);
    for (std::int64_t a = 0; a < rv; ++a) o[a] += row.p[j] * v[a];
  }
}

void expect_upstream(const char* op, const OutputGradients& upstream, const Shape& update,
                     const Shape& statistics) {
  detail::expect_optional_shape(op, "upstream.update", upstream.update, update);
  detail::expect_optional_shape(op, "upstream.lse", upstream.lse, statistics);
  detail::expect_optional_shape(op, "upstream.entropy", upstream.entropy, statistics);
}

/// Which rows take part in one layer's forward pass (§8.6): a query that sees at least one key,
/// a key that at least one such query sees. Indexed [b * Nq + i] and [b * Nk + j].
struct Participation {
  std::vector<char> query, key;
};

Participation participation(const Visibility& v, std::int64_t B, std::int64_t Nq, std::int64_t Nk,
                            bool self_attention) {
  Participation part;
  part.query.assign(static_cast<std::size_t>(B * Nq), 0);
  part.key.assign(static_cast<std::size_t>(B * Nk), 0);
  for (std::int64_t b = 0; b < B; ++b) {
    const emflow::detail::QueryRule rule = rule_of(v, b, Nq, Nk, self_attention);
    for (std::int64_t i = 0; i < Nq; ++i) {
      const KeyRange keys = rule.keys(i);
      if (keys.empty()) continue;
      part.query[static_cast<std::size_t>(b * Nq + i)] = 1;
      for (std::int64_t j = keys.first; j < keys.last; ++j) {
        part.key[static_cast<std::size_t>(b * Nk + j)] = 1;
      }
    }
  }
  return part;
}

/// The visibility handed to the SDPA-shaped operator for a layer: the same rule, with the query
/// lengths of self-attention (the key lengths unless given) made explicit, since the operator
/// always has queries of its own.
Visibility as_cross_attention(const Visibility& v, bool self_attention) {
  Visibility out = v;
  if (self_attention && out.query_lengths.empty()) out.query_lengths = v.key_lengths;
  return out;
}

/// The shapes shared by the dense and the factored layer's backward pass.
struct LayerShape {
  std::int64_t batch = 1, tokens = 0, queries = 0, dim = 0;
  bool batched = false, self_attention = true;
};

LayerShape check_layer_inputs(const char* op, const Tensor<double>& cloud,
                              const Tensor<double>& queries, double beta,
                              const Visibility& visibility) {
  const detail::CloudShape s = detail::cloud_shape(op, "cloud", cloud);
  LayerShape l;
  l.batch = s.batch;
  l.tokens = s.tokens;
  l.dim = s.dim;
  l.batched = s.batched;
  l.self_attention = absent(queries);
  l.queries = s.tokens;
  if (!l.self_attention) {
    const detail::CloudShape q = detail::cloud_shape(op, "queries", queries);
    if (q.batched != s.batched || q.batch != s.batch || q.dim != s.dim) {
      fail_argument(op, "queries", "has shape ", to_string(queries.shape()), ", expected ",
                    s.batched ? "(" + std::to_string(s.batch) + ", Nq, " : "(Nq, ", s.dim, ")");
    }
    l.queries = q.tokens;
  }
  detail::expect_finite_beta(op, beta);
  check_visibility(op, visibility, l.batch, l.queries, l.tokens);
  return l;
}

/// The update's shape: the queries' (N, d) or (B, N, d).
Shape update_shape(const LayerShape& l) {
  return l.batched ? Shape{l.batch, l.queries, l.dim} : Shape{l.queries, l.dim};
}

/// dc = sum of dDelta_i over the queries that take part; zero without an update gradient.
Tensor<double> offset_gradient(const LayerShape& l, const Participation& part,
                               const Tensor<double>& update_gradient) {
  Tensor<double> dc({l.dim});
  if (absent(update_gradient)) return dc;
  for (std::int64_t b = 0; b < l.batch; ++b) {
    for (std::int64_t i = 0; i < l.queries; ++i) {
      if (!part.query[static_cast<std::size_t>(b * l.queries + i)]) continue;
      for (std::int64_t a = 0; a < l.dim; ++a) {
        dc[a] += update_gradient[(b * l.queries + i) * l.dim + a];
      }
    }
  }
  return dc;
}

}  // namespace

SdpaAttention sdpa_attend(const Tensor<double>& queries, const Tensor<double>& keys,
                          const Tensor<double>& values, double scale, const Visibility& visibility,
                          bool with_weights) {
  const char* op = "sdpa_attend";
  const SdpaShape sh = check_sdpa(op, queries, keys, values, scale, visibility);
  const std::int64_t B = sh.batch, H = sh.query_heads, Nq = sh.queries, Nk = sh.keys,
                     rv = sh.value_rank;
  SdpaAttention out;
  out.output = Tensor<double>({B, H, Nq, rv});
  out.lse = Tensor<double>({B, H, Nq});
  out.entropy = Tensor<double>({B, H, Nq});
  if (with_weights) out.weights = Tensor<double>({B, H, Nq, Nk});

  Row row;
  for (std::int64_t b = 0; b < B; ++b) {
    const emflow::detail::QueryRule rule = rule_of(visibility, b, Nq, Nk, /*self_attention=*/false);
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < Nq; ++i) {
        softmax_row(queries, keys, sh, scale, b, h, i, rule.keys(i), row);
        weighted_values(values, sh, b, h, row, out.output.data() + at(b, h, i, 0, H, Nq, rv));
        out.lse[(b * H + h) * Nq + i] = row.lse;
        out.entropy[(b * H + h) * Nq + i] = row.entropy;
        if (with_weights) {
          for (std::int64_t j = 0; j < Nk; ++j) out.weights[at(b, h, i, j, H, Nq, Nk)] = row.p[j];
        }
      }
    }
  }
  return out;
}

namespace {

/// Both forms of sdpa_backward: the statistics recomputed (saved null) or read from `saved`.
SdpaGradients sdpa_backward_rows(const Tensor<double>& queries, const Tensor<double>& keys,
                                 const Tensor<double>& values, double scale,
                                 const Visibility& visibility, const OutputGradients& upstream,
                                 const SdpaAttention* saved) {
  const char* op = "sdpa_backward";
  const SdpaShape sh = check_sdpa(op, queries, keys, values, scale, visibility);
  const std::int64_t B = sh.batch, H = sh.query_heads, Hkv = sh.kv_heads, Nq = sh.queries,
                     Nk = sh.keys, r = sh.rank, rv = sh.value_rank;
  expect_upstream(op, upstream, {B, H, Nq, rv}, {B, H, Nq});
  const bool has_dO = !absent(upstream.update), has_dlse = !absent(upstream.lse),
             has_dH = !absent(upstream.entropy);
  if (saved != nullptr) {
    // What a forward pass returns; O only with dO, H only with dH (the others are not read).
    detail::expect_shape(op, "saved.lse", saved->lse, {B, H, Nq});
    if (has_dO) detail::expect_shape(op, "saved.output", saved->output, {B, H, Nq, rv});
    if (has_dH) detail::expect_shape(op, "saved.entropy", saved->entropy, {B, H, Nq});
  }

  SdpaGradients out;
  out.queries = Tensor<double>(queries.shape());
  out.keys = Tensor<double>(keys.shape());
  out.values = Tensor<double>(values.shape());
  out.scores = Tensor<double>({B, H, Nq, Nk});
  Row row;
  std::vector<double> o(static_cast<std::size_t>(rv));
  for (std::int64_t b = 0; b < B; ++b) {
    const emflow::detail::QueryRule rule = rule_of(visibility, b, Nq, Nk, /*self_attention=*/false);
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / sh.group();
      for (std::int64_t i = 0; i < Nq; ++i) {
        const KeyRange keys_i = rule.keys(i);
        // A query that sees no key has constant outputs (0, -inf, 0): its gradient is 0 and its
        // upstream gradients are not read (§8.6).
        if (keys_i.empty()) continue;
        const std::int64_t stat = (b * H + h) * Nq + i;
        if (saved != nullptr) {
          saved_row(queries, keys, sh, scale, b, h, i, keys_i, saved->lse[stat],
                    has_dH ? saved->entropy[stat] : 0.0, row);
        } else {
          softmax_row(queries, keys, sh, scale, b, h, i, keys_i, row);
        }
        const double* q = queries.data() + at(b, h, i, 0, H, Nq, r);
        const double* dO = has_dO ? upstream.update.data() + at(b, h, i, 0, H, Nq, rv) : nullptr;
        const double dlse = has_dlse ? upstream.lse[stat] : 0.0;
        const double dH = has_dH ? upstream.entropy[stat] : 0.0;

        // D_i = <dO_i, o_i> = sum_j p_ij dP_ij.
        double D = 0.0;
        if (has_dO) {
          if (saved != nullptr) {
            std::copy_n(saved->output.data() + at(b, h, i, 0, H, Nq, rv), rv, o.data());
          } else {
            weighted_values(values, sh, b, h, row, o.data());
          }
          for (std::int64_t a = 0; a < rv; ++a) D += dO[a] * o[a];
        }
        double* dq = out.queries.data() + at(b, h, i, 0, H, Nq, r);
        for (std::int64_t j = keys_i.first; j < keys_i.last; ++j) {
          const double* k = keys.data() + at(b, g, j, 0, Hkv, Nk, r);
          const double* v = values.data() + at(b, g, j, 0, Hkv, Nk, rv);
          const double p = row.p[j];
          // dP_ij = <dO_i, v_j>;  dS_ij = p_ij (dP_ij - D_i + dlse_i - dH_i (s_ij - lse_i + H_i)),
          // the entropy term 0 where p_ij = 0 (p log p -> 0; no 0 * -inf).
          double dP = 0.0;
          if (has_dO) {
            for (std::int64_t a = 0; a < rv; ++a) dP += dO[a] * v[a];
          }
          double dS = p * (dP - D + dlse);
          if (has_dH && p != 0.0) dS -= dH * p * (row.s[j] - row.lse + row.entropy);
          out.scores[at(b, h, i, j, H, Nq, Nk)] = dS;
          out.scale += dS * row.dot[j];

          // dQ_i += scale dS_ij k_j;  dK_j += scale dS_ij q_i;  dV_j += p_ij dO_i.
          double* dk = out.keys.data() + at(b, g, j, 0, Hkv, Nk, r);
          for (std::int64_t a = 0; a < r; ++a) {
            dq[a] += scale * dS * k[a];
            dk[a] += scale * dS * q[a];
          }
          if (has_dO) {
            double* dv = out.values.data() + at(b, g, j, 0, Hkv, Nk, rv);
            for (std::int64_t a = 0; a < rv; ++a) dv[a] += p * dO[a];
          }
        }
      }
    }
  }
  return out;
}

}  // namespace

SdpaGradients sdpa_backward(const Tensor<double>& queries, const Tensor<double>& keys,
                            const Tensor<double>& values, double scale,
                            const Visibility& visibility, const OutputGradients& upstream) {
  return sdpa_backward_rows(queries, keys, values, scale, visibility, upstream, nullptr);
}

SdpaGradients sdpa_backward(const Tensor<double>& queries, const Tensor<double>& keys,
                            const Tensor<double>& values, double scale,
                            const Visibility& visibility, const OutputGradients& upstream,
                            const SdpaAttention& saved) {
  return sdpa_backward_rows(queries, keys, values, scale, visibility, upstream, &saved);
}

LayerGradients attend_backward(const Tensor<double>& cloud, const Tensor<double>& queries,
                               const Layer& layer, double beta, const Visibility& visibility,
                               const OutputGradients& upstream) {
  const char* op = "attend_backward";
  const LayerShape l = check_layer_inputs(op, cloud, queries, beta, visibility);
  const std::int64_t B = l.batch, N = l.tokens, Nq = l.queries, d = l.dim;
  if (layer.relevance.rank() != 2 && layer.relevance.rank() != 3) {
    fail_argument(op, "relevance", "has shape ", to_string(layer.relevance.shape()),
                  ", expected (H, ", d, ", ", d, ") or (", d, ", ", d, ")");
  }
  const bool stacked = layer.relevance.rank() == 3;
  const std::int64_t H = layer.heads();
  if (H < 1) fail_argument(op, "relevance", "must have at least one head, got ", H);
  const Shape operator_shape = stacked ? Shape{H, d, d} : Shape{d, d};
  detail::expect_shape(op, "relevance", layer.relevance, operator_shape);
  detail::expect_shape(op, "content", layer.content, operator_shape);
  detail::expect_optional_shape(op, "key_bias", layer.key_bias, stacked ? Shape{H, d} : Shape{d});
  detail::expect_optional_shape(op, "offset", layer.offset, {d});
  expect_upstream(op, upstream, update_shape(l), {B, H, Nq});

  // The layer as the SDPA-shaped operator, one key and value head per head (§8.4): queries
  // r_i = M_h^T q_i + u_h, keys x_j, values C_j = F_h x_j, scale beta; dO^h_i = dDelta_i.
  const double* X = cloud.data();
  const double* Qc = l.self_attention ? cloud.data() : queries.data();
  const bool has_bias = !absent(layer.key_bias), has_dO = !absent(upstream.update);
  const double* M = layer.relevance.data();
  const double* F = layer.content.data();
  const Participation part = participation(visibility, B, Nq, N, l.self_attention);
  Tensor<double> R({B, H, Nq, d}), K({B, H, N, d}), C({B, H, N, d});
  OutputGradients head_upstream{Tensor<double>{}, upstream.lse, upstream.entropy};
  if (has_dO) head_upstream.update = Tensor<double>({B, H, Nq, d});
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < Nq; ++i) {
        const double* q = Qc + (b * Nq + i) * d;
        const bool takes_part = part.query[static_cast<std::size_t>(b * Nq + i)];
        for (std::int64_t a = 0; a < d; ++a) {
          double r = has_bias ? layer.key_bias[h * d + a] : 0.0;
          for (std::int64_t k = 0; k < d; ++k) r += M[(h * d + k) * d + a] * q[k];
          R[at(b, h, i, a, H, Nq, d)] = r;
          if (has_dO && takes_part) {
            head_upstream.update[at(b, h, i, a, H, Nq, d)] = upstream.update[(b * Nq + i) * d + a];
          }
        }
      }
      for (std::int64_t j = 0; j < N; ++j) {
        const double* x = X + (b * N + j) * d;
        for (std::int64_t a = 0; a < d; ++a) {
          double c = 0.0;
          for (std::int64_t k = 0; k < d; ++k) c += F[(h * d + a) * d + k] * x[k];
          K[at(b, h, j, a, H, N, d)] = x[a];
          C[at(b, h, j, a, H, N, d)] = c;
        }
      }
    }
  }
  const Visibility sdpa_visibility = as_cross_attention(visibility, l.self_attention);
  const SdpaGradients g = sdpa_backward(R, K, C, beta, sdpa_visibility, head_upstream);

  // The chain rule through the maps, over the rows that take part (§8.4, §8.6):
  // dM_h = Q^T dR_h, du_h = sum_i dr_i, dF_h = dC_h^T X, dQ = sum_h dR_h M_h^T,
  // dX = sum_h (dK_h + dC_h F_h) (+ dQ for self-attention).
  LayerGradients out;
  out.relevance = Tensor<double>(layer.relevance.shape());
  out.content = Tensor<double>(layer.content.shape());
  if (has_bias) out.key_bias = Tensor<double>(layer.key_bias.shape());
  Tensor<double> dQ(update_shape(l)), dX(cloud.shape());
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < Nq; ++i) {
        if (!part.query[static_cast<std::size_t>(b * Nq + i)]) continue;
        const double* q = Qc + (b * Nq + i) * d;
        const double* dr = g.queries.data() + at(b, h, i, 0, H, Nq, d);
        for (std::int64_t k = 0; k < d; ++k) {
          double dq = 0.0;
          for (std::int64_t a = 0; a < d; ++a) {
            out.relevance[(h * d + k) * d + a] += q[k] * dr[a];
            dq += M[(h * d + k) * d + a] * dr[a];
          }
          dQ[(b * Nq + i) * d + k] += dq;
          if (has_bias) out.key_bias[h * d + k] += dr[k];
        }
      }
      for (std::int64_t j = 0; j < N; ++j) {
        if (!part.key[static_cast<std::size_t>(b * N + j)]) continue;
        const double* x = X + (b * N + j) * d;
        const double* dk = g.keys.data() + at(b, h, j, 0, H, N, d);
        const double* dc = g.values.data() + at(b, h, j, 0, H, N, d);
        for (std::int64_t k = 0; k < d; ++k) {
          double dx = dk[k];
          for (std::int64_t a = 0; a < d; ++a) {
            out.content[(h * d + a) * d + k] += dc[a] * x[k];
            dx += F[(h * d + a) * d + k] * dc[a];
          }
          dX[(b * N + j) * d + k] += dx;
        }
      }
    }
  }
  if (l.self_attention) {
    for (std::int64_t e = 0; e < dX.size(); ++e) dX[e] += dQ[e];
  } else {
    out.queries = dQ;
  }
  out.cloud = dX;
  if (!absent(layer.offset)) out.offset = offset_gradient(l, part, upstream.update);
  out.beta = g.scale;
  return out;
}

std::int64_t FactoredLayer::heads() const noexcept {
  return query_factor.rank() == 3 ? query_factor.extent(0) : 0;
}

std::int64_t FactoredLayer::rank() const noexcept {
  return query_factor.rank() == 3 ? query_factor.extent(1) : 0;
}

emflow::FactoredLayer<double> FactoredLayer::operators() const {
  emflow::FactoredLayer<double> view;
  view.heads = heads();
  view.rank = rank();
  view.query_factor = query_factor.data();
  view.key_factor = key_factor.data();
  view.content_up = content_up.data();
  view.content_down = content_down.data();
  view.key_bias = absent(key_bias) ? nullptr : key_bias.data();
  view.offset = absent(offset) ? nullptr : offset.data();
  return view;
}

FactoredGradients attend_factored_backward(const Tensor<double>& cloud,
                                           const Tensor<double>& queries,
                                           const FactoredLayer& layer, double beta,
                                           const Visibility& visibility,
                                           const OutputGradients& upstream) {
  const char* op = "attend_factored_backward";
  const LayerShape l = check_layer_inputs(op, cloud, queries, beta, visibility);
  const std::int64_t B = l.batch, N = l.tokens, Nq = l.queries, d = l.dim;
  const std::int64_t H = layer.heads(), r = layer.rank();
  if (H < 1 || r < 1 || layer.query_factor.extent(2) != d) {
    fail_argument(op, "query_factor", "has shape ", to_string(layer.query_factor.shape()),
                  ", expected (H, r, ", d, ") with H, r >= 1");
  }
  detail::expect_shape(op, "key_factor", layer.key_factor, {H, r, d});
  detail::expect_shape(op, "content_up", layer.content_up, {H, d, r});
  detail::expect_shape(op, "content_down", layer.content_down, {H, r, d});
  detail::expect_optional_shape(op, "key_bias", layer.key_bias, {H, d});
  detail::expect_optional_shape(op, "offset", layer.offset, {d});
  expect_upstream(op, upstream, update_shape(l), {B, H, Nq});

  // The layer as the SDPA-shaped operator (§8.5): queries (A_h q_i, 1) and keys
  // (B_h x_j, w_j = u_h^T x_j) of rank r + 1 with a key bias (else A_h q_i and B_h x_j), values
  // y_j = V_h x_j, scale beta; dO^h_i = U_h^T dDelta_i for the queries that take part.
  const bool has_bias = !absent(layer.key_bias), has_dO = !absent(upstream.update);
  const std::int64_t rs = has_bias ? r + 1 : r;  // the rank of the scores' product
  const double* X = cloud.data();
  const double* Qc = l.self_attention ? cloud.data() : queries.data();
  const double* A = layer.query_factor.data();
  const double* Bf = layer.key_factor.data();
  const double* U = layer.content_up.data();
  const double* Vf = layer.content_down.data();
  const Participation part = participation(visibility, B, Nq, N, l.self_attention);
  Tensor<double> Qs({B, H, Nq, rs}), Ks({B, H, N, rs}), Y({B, H, N, r});
  OutputGradients head_upstream{Tensor<double>{}, upstream.lse, upstream.entropy};
  if (has_dO) head_upstream.update = Tensor<double>({B, H, Nq, r});
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < Nq; ++i) {
        const double* q = Qc + (b * Nq + i) * d;
        for (std::int64_t p = 0; p < r; ++p) {
          double s = 0.0;
          for (std::int64_t k = 0; k < d; ++k) s += A[(h * r + p) * d + k] * q[k];
          Qs[at(b, h, i, p, H, Nq, rs)] = s;
        }
        if (has_bias) Qs[at(b, h, i, r, H, Nq, rs)] = 1.0;
        if (!has_dO || !part.query[static_cast<std::size_t>(b * Nq + i)]) continue;
        const double* dDelta = upstream.update.data() + (b * Nq + i) * d;
        for (std::int64_t p = 0; p < r; ++p) {
          double dO = 0.0;
          for (std::int64_t a = 0; a < d; ++a) dO += U[(h * d + a) * r + p] * dDelta[a];
          head_upstream.update[at(b, h, i, p, H, Nq, r)] = dO;
        }
      }
      for (std::int64_t j = 0; j < N; ++j) {
        const double* x = X + (b * N + j) * d;
        for (std::int64_t p = 0; p < r; ++p) {
          double k = 0.0, y = 0.0;
          for (std::int64_t c = 0; c < d; ++c) {
            k += Bf[(h * r + p) * d + c] * x[c];
            y += Vf[(h * r + p) * d + c] * x[c];
          }
          Ks[at(b, h, j, p, H, N, rs)] = k;
          Y[at(b, h, j, p, H, N, r)] = y;
        }
        if (has_bias) {
          double w = 0.0;
          for (std::int64_t c = 0; c < d; ++c) w += layer.key_bias[h * d + c] * x[c];
          Ks[at(b, h, j, r, H, N, rs)] = w;
        }
      }
    }
  }
  const Visibility sdpa_visibility = as_cross_attention(visibility, l.self_attention);
  const SdpaGradients g = sdpa_backward(Qs, Ks, Y, beta, sdpa_visibility, head_upstream);
  // The heads' averages o^h_i = sum_j p_ij y_j, for dU_h = dDelta^T O_h.
  const Tensor<double> O =
      has_dO ? sdpa_attend(Qs, Ks, Y, beta, sdpa_visibility).output : Tensor<double>{};

  // The chain rule through the projections, over the rows that take part (§8.5, §8.6):
  // dA_h = dQ_h^T Q, dB_h = dK_h^T X, dV_h = dY_h^T X, du_h = X^T dw_h, dU_h = dDelta^T O_h,
  // dQ = sum_h dQ_h A_h, dX = sum_h (dK_h B_h + dY_h V_h + dw_h u_h^T) (+ dQ for self-attention).
  // The gradient of the constant query coordinate 1 is dropped.
  FactoredGradients out;
  out.query_factor = Tensor<double>(layer.query_factor.shape());
  out.key_factor = Tensor<double>(layer.key_factor.shape());
  out.content_up = Tensor<double>(layer.content_up.shape());
  out.content_down = Tensor<double>(layer.content_down.shape());
  if (has_bias) out.key_bias = Tensor<double>(layer.key_bias.shape());
  Tensor<double> dQ(update_shape(l)), dX(cloud.shape());
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < Nq; ++i) {
        if (!part.query[static_cast<std::size_t>(b * Nq + i)]) continue;
        const double* q = Qc + (b * Nq + i) * d;
        const double* dq = g.queries.data() + at(b, h, i, 0, H, Nq, rs);
        for (std::int64_t k = 0; k < d; ++k) {
          double dx = 0.0;
          for (std::int64_t p = 0; p < r; ++p) {
            out.query_factor[(h * r + p) * d + k] += dq[p] * q[k];
            dx += A[(h * r + p) * d + k] * dq[p];
          }
          dQ[(b * Nq + i) * d + k] += dx;
        }
        if (!has_dO) continue;
        const double* dDelta = upstream.update.data() + (b * Nq + i) * d;
        const double* o = O.data() + at(b, h, i, 0, H, Nq, r);
        for (std::int64_t a = 0; a < d; ++a) {
          for (std::int64_t p = 0; p < r; ++p)
            out.content_up[(h * d + a) * r + p] += dDelta[a] * o[p];
        }
      }
      for (std::int64_t j = 0; j < N; ++j) {
        if (!part.key[static_cast<std::size_t>(b * N + j)]) continue;
        const double* x = X + (b * N + j) * d;
        const double* dk = g.keys.data() + at(b, h, j, 0, H, N, rs);
        const double* dy = g.values.data() + at(b, h, j, 0, H, N, r);
        const double dw = has_bias ? dk[r] : 0.0;
        for (std::int64_t k = 0; k < d; ++k) {
          double dx = has_bias ? dw * layer.key_bias[h * d + k] : 0.0;
          for (std::int64_t p = 0; p < r; ++p) {
            out.key_factor[(h * r + p) * d + k] += dk[p] * x[k];
            out.content_down[(h * r + p) * d + k] += dy[p] * x[k];
            dx += Bf[(h * r + p) * d + k] * dk[p] + Vf[(h * r + p) * d + k] * dy[p];
          }
          if (has_bias) out.key_bias[h * d + k] += dw * x[k];
          dX[(b * N + j) * d + k] += dx;
        }
      }
    }
  }
  if (l.self_attention) {
    for (std::int64_t e = 0; e < dX.size(); ++e) dX[e] += dQ[e];
  } else {
    out.queries = dQ;
  }
  out.cloud = dX;
  if (!absent(layer.offset)) out.offset = offset_gradient(l, part, upstream.update);
  out.beta = g.scale;
  return out;
}

}  // namespace emflow::reference
