// The EMF operations of docs/MATH.md §1, one function each, in double precision. Written as the
// formulas read (plain loops over b, i, j and the coordinates), not for speed: these are the
// ground truth that tests hold the fused backends against.
#include <algorithm>
#include <cmath>
#include <limits>

#include "checks.hpp"
#include "emflow/reference.hpp"

namespace emflow::reference {

namespace {

using detail::CloudShape;
using detail::fail_argument;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Index of element (b, i, a) of a dense (B, rows, cols) array.
std::int64_t at(std::int64_t b, std::int64_t i, std::int64_t a, std::int64_t rows,
                std::int64_t cols) {
  return (b * rows + i) * cols + a;
}

// Every token mapped by a (d, d) matrix A given element by element: row i of the result is
// A x_i, y_{b,i,a} = sum_k A(a, k) x_{b,i,k}, summed over k in order.
template <class Element>
Tensor<double> map_tokens(const Tensor<double>& cloud, const CloudShape& s, Element element) {
  Tensor<double> Y(cloud.shape());
  const std::int64_t N = s.tokens, d = s.dim;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t i = 0; i < N; ++i) {
      for (std::int64_t a = 0; a < d; ++a) {
        double y = 0.0;
        for (std::int64_t k = 0; k < d; ++k) y += element(a, k) * cloud[at(b, i, k, N, d)];
        Y[at(b, i, a, N, d)] = y;
      }
    }
  }
  return Y;
}

// Head h's (d, d) operator or (d) bias from a per-head stack (H, ...), or from a layer given
// without the head axis (then h is 0).
Tensor<double> head_slice(const Tensor<double>& stacked, std::int64_t h, const Shape& slice) {
  const std::int64_t n = checked_element_count(slice, "slice");
  const auto first = stacked.values().begin() + h * n;
  return Tensor<double>(slice, std::vector<double>(first, first + n));
}

}  // namespace

Tensor<double> relevance_gradients(const Tensor<double>& cloud, const Tensor<double>& relevance) {
  const char* op = "relevance_gradients";
  const CloudShape s = detail::cloud_shape(op, "cloud", cloud);
  detail::expect_shape(op, "relevance", relevance, {s.dim, s.dim});

  // R = X M: r_{b,i,a} = sum_k x_{b,i,k} M_{k,a}, i.e. row i is (M^T x_i)^T.
  const std::int64_t d = s.dim;
  return map_tokens(cloud, s, [&](std::int64_t a, std::int64_t k) { return relevance[k * d + a]; });
}

Tensor<double> scores(const Tensor<double>& relevance_gradients, const Tensor<double>& cloud,
                      const Tensor<double>& key_bias, double beta, const Mask& mask,
                      const std::vector<std::int64_t>& key_lengths) {
  const char* op = "scores";
  const CloudShape s = detail::cloud_shape(op, "cloud", cloud);
  detail::expect_shape(op, "relevance_gradients", relevance_gradients, cloud.shape());
  detail::expect_optional_shape(op, "key_bias", key_bias, {s.dim});
  detail::expect_finite_beta(op, beta);
  detail::expect_valid_mask(op, mask);
  detail::expect_key_lengths(op, key_lengths, s);

  // S = beta (R X^T + 1 u^T X^T): s_ij = beta (<r_i, x_j> + <u, x_j>), -inf where masked.
  const std::int64_t N = s.tokens, d = s.dim;
  const bool has_bias = !absent(key_bias);
  Tensor<double> S(s.with_tail({N, N}));
  for (std::int64_t b = 0; b < s.batch; ++b) {
    const std::int64_t length = detail::key_length(key_lengths, b, N);
    for (std::int64_t i = 0; i < N; ++i) {
      for (std::int64_t j = 0; j < N; ++j) {
        if (!detail::visible(mask, length, i, j)) {
          S[at(b, i, j, N, N)] = -kInf;
          continue;
        }
        double relevance = 0.0, bias = 0.0;
        for (std::int64_t k = 0; k < d; ++k) {
          const double x_jk = cloud[at(b, j, k, N, d)];
          relevance += relevance_gradients[at(b, i, k, N, d)] * x_jk;
          if (has_bias) bias += key_bias[k] * x_jk;
        }
        S[at(b, i, j, N, N)] = beta * (relevance + bias);
      }
    }
  }
  return S;
}

Softmax masked_softmax(const Tensor<double>& scores) {
  const char* op = "masked_softmax";
  if (scores.rank() < 1 || scores.rank() > 4) {
    fail_argument(op, "scores", "has shape ", to_string(scores.shape()), ", expected rank 1 to 4");
  }
  const std::int64_t keys = scores.extent(scores.rank() - 1);
  if (keys < 1) {
    fail_argument(op, "scores", "has shape ", to_string(scores.shape()),
                  ", expected at least one key on the last axis");
  }
  for (std::int64_t e = 0; e < scores.size(); ++e) {
    if (std::isnan(scores[e]) || scores[e] == kInf) {
      fail_argument(op, "scores", "entry ", e, " is ", scores[e],
                    ", expected a finite value or -inf");
    }
  }

  Shape row_shape(scores.shape().begin(), scores.shape().end() - 1);
  Softmax out{Tensor<double>(scores.shape()), Tensor<double>(row_shape), Tensor<double>(row_shape)};
  const std::int64_t rows = scores.size() / keys;
  for (std::int64_t row = 0; row < rows; ++row) {
    const double* s = scores.data() + row * keys;
    double* p = out.weights.data() + row * keys;

    // m_i = max_j s_ij. All -inf: no visible key, so p_i = 0, lse_i = -inf, H_i = 0.
    const double m = *std::max_element(s, s + keys);
    if (m == -kInf) {
      std::fill(p, p + keys, 0.0);
      out.lse[row] = -kInf;
      out.entropy[row] = 0.0;
      continue;
    }

    // Z_i = sum_j exp(s_ij - m_i) >= 1 (the maximum contributes exp(0)); lse_i = m_i + log Z_i.
    double Z = 0.0;
    for (std::int64_t j = 0; j < keys; ++j) Z += std::exp(s[j] - m);
    const double lse = m + std::log(Z);

    // p_ij = exp(s_ij - lse_i); H_i = lse_i - sum_j p_ij s_ij (masked keys have p = 0 and add
    // nothing: skipping them avoids 0 * -inf).
    double expected_score = 0.0;
    for (std::int64_t j = 0; j < keys; ++j) {
      p[j] = std::exp(s[j] - lse);
      if (p[j] > 0.0) expected_score += p[j] * s[j];
    }
    out.lse[row] = lse;
    out.entropy[row] = lse - expected_score;
  }
  return out;
}

Tensor<double> content(const Tensor<double>& cloud, const Tensor<double>& content) {
  const char* op = "content";
  const CloudShape s = detail::cloud_shape(op, "cloud", cloud);
  detail::expect_shape(op, "content", content, {s.dim, s.dim});

  // C = X F^T: c_{b,j,a} = sum_k F_{a,k} x_{b,j,k}, i.e. row j is (F x_j)^T.
  const std::int64_t d = s.dim;
  return map_tokens(cloud, s, [&](std::int64_t a, std::int64_t k) { return content[a * d + k]; });
}

Tensor<double> contextual_update(const Tensor<double>& weights, const Tensor<double>& content,
                                 const Tensor<double>& offset) {
  const char* op = "contextual_update";
  const CloudShape s = detail::cloud_shape(op, "content", content);
  detail::expect_shape(op, "weights", weights, s.with_tail({s.tokens, s.tokens}));
  detail::expect_optional_shape(op, "offset", offset, {s.dim});

  // delta_i = sum_j p_ij C_j + c for a query that sees a key; 0 for one that sees none.
  const std::int64_t N = s.tokens, d = s.dim;
  const bool has_offset = !absent(offset);
  Tensor<double> delta(content.shape());
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t i = 0; i < N; ++i) {
      bool sees_a_key = false;
      for (std::int64_t j = 0; j < N; ++j) {
        const double p = weights[at(b, i, j, N, N)];
        if (p == 0.0) continue;
        sees_a_key = true;
        for (std::int64_t a = 0; a < d; ++a)
          delta[at(b, i, a, N, d)] += p * content[at(b, j, a, N, d)];
      }
      if (sees_a_key && has_offset) {
        for (std::int64_t a = 0; a < d; ++a) delta[at(b, i, a, N, d)] += offset[a];
      }
    }
  }
  return delta;
}

Tensor<double> residual_update(const Tensor<double>& cloud, const Tensor<double>& update) {
  const char* op = "residual_update";
  detail::cloud_shape(op, "cloud", cloud);
  detail::expect_shape(op, "update", update, cloud.shape());

  // X* = X + Delta(X).
  Tensor<double> next(cloud.shape());
  for (std::int64_t e = 0; e < cloud.size(); ++e) next[e] = cloud[e] + update[e];
  return next;
}

LayerOperators<double> Layer::operators() const {
  LayerOperators<double> view;
  view.heads = heads();
  view.relevance = relevance.data();
  view.content = content.data();
  view.key_bias = absent(key_bias) ? nullptr : key_bias.data();
  view.offset = absent(offset) ? nullptr : offset.data();
  return view;
}

Attention attend(const Tensor<double>& cloud, const Layer& layer, double beta, const Mask& mask,
                 const std::vector<std::int64_t>& key_lengths, bool with_weights) {
  const char* op = "reference::attend";
  const CloudShape s = detail::cloud_shape(op, "cloud", cloud);
  const std::int64_t B = s.batch, N = s.tokens, d = s.dim;
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
  detail::expect_finite_beta(op, beta);
  detail::expect_valid_mask(op, mask);
  detail::expect_key_lengths(op, key_lengths, s);

  // The heads run on the batched view of the cloud; the update is reshaped back at the end.
  const Tensor<double> X = cloud.reshaped({B, N, d});
  Attention out;
  out.lse = Tensor<double>({B, H, N});
  out.entropy = Tensor<double>({B, H, N});
  if (with_weights) out.weights = Tensor<double>({B, H, N, N});
  Tensor<double> delta({B, N, d});

  for (std::int64_t h = 0; h < H; ++h) {
    const Tensor<double> M = head_slice(layer.relevance, h, {d, d});
    const Tensor<double> F = head_slice(layer.content, h, {d, d});
    const Tensor<double> u =
        absent(layer.key_bias) ? Tensor<double>{} : head_slice(layer.key_bias, h, {d});

    const Tensor<double> R = relevance_gradients(X, M);
    const Softmax softmax = masked_softmax(scores(R, X, u, beta, mask, key_lengths));
    // The offset c belongs to the layer, not to a head: add it once, with the first head. Every
    // head sees the same keys, so a query without keys gets no offset in any head.
    const Tensor<double> head_update =
        contextual_update(softmax.weights, content(X, F), h == 0 ? layer.offset : Tensor<double>{});

    for (std::int64_t e = 0; e < delta.size(); ++e) delta[e] += head_update[e];
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t i = 0; i < N; ++i) {
        out.lse[at(b, h, i, H, N)] = softmax.lse[b * N + i];
        out.entropy[at(b, h, i, H, N)] = softmax.entropy[b * N + i];
        if (!with_weights) continue;
        for (std::int64_t j = 0; j < N; ++j) {
          out.weights[(at(b, h, i, H, N)) * N + j] = softmax.weights[at(b, i, j, N, N)];
        }
      }
    }
  }
  out.update = delta.reshaped(cloud.shape());
  return out;
}

}  // namespace emflow::reference
