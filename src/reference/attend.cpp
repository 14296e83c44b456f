// The double-precision reference of the EMF contextual update, written for clarity: each line
// is a formula of docs/MATH.md §1. It is the ground truth every backend is tested against.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/backends.hpp"

namespace emflow::detail {

template <class T>
void reference_attend(const AttentionInput<T>& in, const AttentionOutput<T>& out) {
  const std::int64_t B = in.batch, N = in.tokens, d = in.dim, H = in.layer.heads;
  const double inf = std::numeric_limits<double>::infinity();

  std::vector<double> R(static_cast<std::size_t>(N * d));  // relevance gradients R = X M_h
  std::vector<double> C(static_cast<std::size_t>(N * d));  // content C = X F_h^T
  std::vector<double> s(static_cast<std::size_t>(N));      // one query's scores
  std::vector<double> delta(static_cast<std::size_t>(N * d));

  for (std::int64_t b = 0; b < B; ++b) {
    const T* X = in.cloud + b * N * d;
    const std::int64_t length = in.key_lengths ? in.key_lengths[b] : N;
    std::fill(delta.begin(), delta.end(), 0.0);

    for (std::int64_t h = 0; h < H; ++h) {
      const T* M = in.layer.relevance + h * d * d;
      const T* F = in.layer.content + h * d * d;
      const T* u = in.layer.key_bias ? in.layer.key_bias + h * d : nullptr;

      // R = X M (row i is r_{x_i}^T = x_i^T M), C = X F^T (row j is (F x_j)^T).
      for (std::int64_t i = 0; i < N; ++i) {
        for (std::int64_t a = 0; a < d; ++a) {
          double r = 0.0, c = 0.0;
          for (std::int64_t k = 0; k < d; ++k) {
            r += static_cast<double>(X[i * d + k]) * static_cast<double>(M[k * d + a]);
            c += static_cast<double>(F[a * d + k]) * static_cast<double>(X[i * d + k]);
          }
          R[i * d + a] = r;
          C[i * d + a] = c;
        }
      }

      for (std::int64_t i = 0; i < N; ++i) {
        // s_ij = beta * (<r_i, x_j> + <u, x_j>), -inf where masked (the mask and the key length
        // L_b); m_i = max_j s_ij, NaN as soon as one visible score is NaN (docs/MATH.md §6.6).
        const KeyRange keys = in.mask.visible_keys(i, length);
        double m = -inf;
        for (std::int64_t j = 0; j < N; ++j) {
          if (!keys.contains(j)) {
            s[j] = -inf;
            continue;
          }
          double score = 0.0;
          for (std::int64_t k = 0; k < d; ++k) {
            const double xk = static_cast<double>(X[j * d + k]);
            score += (R[i * d + k] + (u ? static_cast<double>(u[k]) : 0.0)) * xk;
          }
          s[j] = in.beta * score;
          if (s[j] > m || std::isnan(s[j])) m = s[j];  // m stays NaN once it is NaN
        }

        const std::int64_t row = (b * H + h) * N + i;
        T* weights_row = out.weights ? out.weights + row * N : nullptr;
        if (keys.empty()) {  // no visible key: delta_i = 0, lse_i = -inf, H_i = 0, p_i = 0
          if (out.lse) out.lse[row] = static_cast<T>(-inf);
          if (out.entropy) out.entropy[row] = T(0);
          if (weights_row) std::fill(weights_row, weights_row + N, T(0));
          continue;
        }
        if (!std::isfinite(m)) {
          // A NaN or +inf score, or only -inf ones: the weights are undefined, so the head's lse,
          // entropy, visible weights and its share of delta_i are NaN.
          const double nan = std::numeric_limits<double>::quiet_NaN();
          if (out.lse) out.lse[row] = static_cast<T>(nan);
          if (out.entropy) out.entropy[row] = static_cast<T>(nan);
          if (weights_row) {
            for (std::int64_t j = 0; j < N; ++j) {
              weights_row[j] = keys.contains(j) ? static_cast<T>(nan) : T(0);
            }
          }
          for (std::int64_t a = 0; a < d; ++a) delta[i * d + a] = nan;
          continue;
        }

        // Z_i = sum_j exp(s_ij - m_i); lse_i = m_i + log Z_i; p_ij = exp(s_ij - lse_i).
        double Z = 0.0;
        for (std::int64_t j = 0; j < N; ++j) {
          if (s[j] != -inf) Z += std::exp(s[j] - m);
        }
        const double lse = m + std::log(Z);

        // delta_i += sum_j p_ij F x_j;  H_i = lse_i - sum_j p_ij s_ij. Every visible key's
        // content is weighted, even with p_ij = 0 (a score of -inf, or one that underflows), so a
        // non-finite F x_j reaches exactly the queries that see key j, as in the fused backends.
        double expected_score = 0.0;
        for (std::int64_t j = 0; j < N; ++j) {
          const double p = (s[j] == -inf) ? 0.0 : std::exp(s[j] - lse);
          if (weights_row) weights_row[j] = static_cast<T>(p);
          if (!keys.contains(j)) continue;
          if (p > 0.0) expected_score += p * s[j];
          for (std::int64_t a = 0; a < d; ++a) delta[i * d + a] += p * C[j * d + a];
        }
        if (out.lse) out.lse[row] = static_cast<T>(lse);
        if (out.entropy) out.entropy[row] = static_cast<T>(lse - expected_score);
      }
    }

    // delta_i += c for every query that sees at least one key; write Delta.
    T* D = out.update + b * N * d;
    for (std::int64_t i = 0; i < N; ++i) {
      const bool any_key = !in.mask.visible_keys(i, length).empty();
      for (std::int64_t a = 0; a < d; ++a) {
        double value = delta[i * d + a];
        if (any_key && in.layer.offset) value += static_cast<double>(in.layer.offset[a]);
        D[i * d + a] = static_cast<T>(value);
      }
    }
  }
}

template void reference_attend<float>(const AttentionInput<float>&, const AttentionOutput<float>&);
template void reference_attend<double>(const AttentionInput<double>&,
                                       const AttentionOutput<double>&);

}  // namespace emflow::detail
