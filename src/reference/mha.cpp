// Standard multi-head attention in double, and its exact EMF form (docs/MATH.md §3).
//
// mha_reference computes attention the way every framework does (project, score, softmax,
// weight the values, project out) so that it shares no code path with the EMF operations: the
// tests hold reference::attend(X, to_emf(w)) against it.
#include "emflow/mha.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "checks.hpp"

namespace emflow {

namespace {

using reference::detail::CloudShape;
using reference::detail::expect_optional_shape;
using reference::detail::expect_shape;

constexpr double kInf = std::numeric_limits<double>::infinity();

// A bias entry, 0 when the bias is absent.
double bias_at(const Tensor<double>& bias, std::int64_t k) {
  return reference::absent(bias) ? 0.0 : bias[k];
}

}  // namespace

void validate(const MultiHeadAttentionWeights& w, const char* op) {
  emflow::detail::expect_positive(op, "heads", w.heads);
  emflow::detail::expect_positive(op, "model_dim", w.model_dim);
  emflow::detail::expect_positive(op, "head_dim", w.head_dim);
  emflow::detail::expect_positive(op, "value_dim", w.value_dim);
  const std::int64_t d = w.model_dim;
  const std::int64_t qk = emflow::detail::checked_multiply(op, "head_dim", w.heads, w.head_dim);
  const std::int64_t v = emflow::detail::checked_multiply(op, "value_dim", w.heads, w.value_dim);
  expect_shape(op, "query", w.query, {qk, d});
  expect_shape(op, "key", w.key, {qk, d});
  expect_shape(op, "value", w.value, {v, d});
  expect_shape(op, "output", w.output, {d, v});
  expect_optional_shape(op, "query_bias", w.query_bias, {qk});
  expect_optional_shape(op, "key_bias", w.key_bias, {qk});
  expect_optional_shape(op, "value_bias", w.value_bias, {v});
  expect_optional_shape(op, "output_bias", w.output_bias, {d});
}

reference::Layer to_emf(const MultiHeadAttentionWeights& w) {
  validate(w, "to_emf");
  const std::int64_t H = w.heads, d = w.model_dim, dk = w.head_dim, dv = w.value_dim;
  const std::int64_t qk_cols = d, out_cols = H * dv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));

  reference::Layer layer;
  layer.relevance = Tensor<double>({H, d, d});
  layer.content = Tensor<double>({H, d, d});
  layer.key_bias = Tensor<double>({H, d});
  layer.offset = Tensor<double>({d});

  for (std::int64_t h = 0; h < H; ++h) {
    // Head h's rows of W_Q, W_K (h*dk + r) and W_V (h*dv + r); its columns of W_O (h*dv + r).
    auto W_Q = [&](std::int64_t r, std::int64_t k) { return w.query[(h * dk + r) * qk_cols + k]; };
    auto W_K = [&](std::int64_t r, std::int64_t k) { return w.key[(h * dk + r) * qk_cols + k]; };
    auto W_V = [&](std::int64_t r, std::int64_t k) { return w.value[(h * dv + r) * d + k]; };
    auto W_O = [&](std::int64_t a, std::int64_t r) { return w.output[a * out_cols + h * dv + r]; };

    for (std::int64_t a = 0; a < d; ++a) {
      for (std::int64_t b = 0; b < d; ++b) {
        // M_h = W_Q,h^T W_K,h / sqrt(d_k).
        double m = 0.0;
        for (std::int64_t r = 0; r < dk; ++r) m += W_Q(r, a) * W_K(r, b);
        layer.relevance[(h * d + a) * d + b] = m * scale;
        // F_h = W_O,h W_V,h.
        double f = 0.0;
        for (std::int64_t r = 0; r < dv; ++r) f += W_O(a, r) * W_V(r, b);
        layer.content[(h * d + a) * d + b] = f;
      }
      // u_h = W_K,h^T b_Q,h / sqrt(d_k).
      double u = 0.0;
      for (std::int64_t r = 0; r < dk; ++r) u += W_K(r, a) * bias_at(w.query_bias, h * dk + r);
      layer.key_bias[h * d + a] = u * scale;
    }
  }
  // c = sum_h W_O,h b_V,h + b_O = W_O b_V + b_O.
  for (std::int64_t a = 0; a < d; ++a) {
    double c = bias_at(w.output_bias, a);
    for (std::int64_t r = 0; r < H * dv; ++r)
      c += w.output[a * out_cols + r] * bias_at(w.value_bias, r);
    layer.offset[a] = c;
  }
  return layer;
}

Tensor<double> mha_reference(const MultiHeadAttentionWeights& w, const Tensor<double>& cloud,
                             const Mask& mask, const std::vector<std::int64_t>& key_lengths) {
  const char* op = "mha_reference";
  validate(w, op);
  const CloudShape s = reference::detail::cloud_shape(op, "cloud", cloud);
  if (s.dim != w.model_dim) {
    emflow::detail::fail_argument(op, "cloud", "has shape ", to_string(cloud.shape()),
                                  ", expected last extent model_dim = ", w.model_dim);
  }
  reference::detail::expect_valid_mask(op, mask);
  reference::detail::expect_key_lengths(op, key_lengths, s);

  const std::int64_t B = s.batch, N = s.tokens, d = s.dim;
  const std::int64_t H = w.heads, dk = w.head_dim, dv = w.value_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));

  // y = W x + b for every token of cloud b: (N, rows) from a (rows, d) weight.
  auto project = [&](const Tensor<double>& W, const Tensor<double>& bias, std::int64_t b) {
    const std::int64_t rows = W.extent(0);
    std::vector<double> y(static_cast<std::size_t>(N * rows));
    for (std::int64_t t = 0; t < N; ++t) {
      for (std::int64_t r = 0; r < rows; ++r) {
        double sum = bias_at(bias, r);
        for (std::int64_t k = 0; k < d; ++k) sum += W[r * d + k] * cloud[(b * N + t) * d + k];
        y[static_cast<std::size_t>(t * rows + r)] = sum;
      }
    }
    return y;
  };

  Tensor<double> out(cloud.shape());
  std::vector<double> logits(static_cast<std::size_t>(N));
  std::vector<double> heads_out(static_cast<std::size_t>(H * dv));  // concat_h o_h(i)
  for (std::int64_t b = 0; b < B; ++b) {
    const std::vector<double> q = project(w.query, w.query_bias, b);  // (N, H*dk)
    const std::vector<double> k = project(w.key, w.key_bias, b);      // (N, H*dk)
    const std::vector<double> v = project(w.value, w.value_bias, b);  // (N, H*dv)
    const std::int64_t length = reference::detail::key_length(key_lengths, b, N);

    for (std::int64_t i = 0; i < N; ++i) {
      bool sees_a_key = false;
      for (std::int64_t h = 0; h < H; ++h) {
        // logits_j = q_i . k_j / sqrt(d_k) over visible keys; softmax with the max subtracted.
        double top = -kInf;
        for (std::int64_t j = 0; j < N; ++j) {
          double dot = -kInf;
          if (reference::detail::visible(mask, length, i, j)) {
            dot = 0.0;
            for (std::int64_t r = 0; r < dk; ++r) {
              dot += q[static_cast<std::size_t>(i * H * dk + h * dk + r)] *
                     k[static_cast<std::size_t>(j * H * dk + h * dk + r)];
            }
            dot *= scale;
          }
          logits[static_cast<std::size_t>(j)] = dot;
          top = std::max(top, dot);
        }
        double* o = heads_out.data() + h * dv;
        std::fill(o, o + dv, 0.0);
        if (top == -kInf) continue;
        sees_a_key = true;
        double total = 0.0;
        for (double& l : logits) {
          l = (l == -kInf) ? 0.0 : std::exp(l - top);
          total += l;
        }
        // o_h(i) = sum_j softmax_j v_j.
        for (std::int64_t j = 0; j < N; ++j) {
          const double p = logits[static_cast<std::size_t>(j)] / total;
          for (std::int64_t r = 0; r < dv; ++r) {
            o[r] += p * v[static_cast<std::size_t>(j * H * dv + h * dv + r)];
          }
        }
      }
      if (!sees_a_key) continue;  // no visible key: the update stays 0
      // out_i = W_O concat_h o_h(i) + b_O.
      for (std::int64_t a = 0; a < d; ++a) {
        double sum = bias_at(w.output_bias, a);
        for (std::int64_t r = 0; r < H * dv; ++r) sum += w.output[a * H * dv + r] * heads_out[r];
        out[(b * N + i) * d + a] = sum;
      }
    }
  }
  return out;
}

}  // namespace emflow
